"""The verl job's shared scorer (``draco_cli.trainers.verl.scorer.DracoScorerActor``, the class
Ray makes the named actor of) driven directly: a finished session waits for the rest of its
group, but never forever — a session that never arrives or one that failed ends the wait with an
error naming the group and what arrived — and a prompt's own number of sessions is its group."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import polars as pl
import pytest

from draco_cli.errors import InputError
from draco_cli.trainers.verl.scorer import DracoScorerActor
from tests.conftest import run_draco

TOKENIZER = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


def actor(tmp_path, **config) -> DracoScorerActor:
    return DracoScorerActor({"model": "mock/judge", "call_log": str(tmp_path / "log.sqlite"),
                             **config}, 4, TOKENIZER)


def session(a: DracoScorerActor, uid: str, k: int, step: int = 3, size: int | None = None):
    return a.score({"rollout_id": f"{uid}-{k}", "group_id": uid, "instruction": "do it",
                    "response_ids": [5, 6 + k, 7, 8 + k], "response_mask": [1, 1, 0, 1],
                    "outcome": float(k % 2), "train_step": step}, size)


def test_a_group_short_of_a_session_fails_naming_what_arrived(tmp_path):
    async def main():
        a = actor(tmp_path, wait_timeout=0.5)
        try:
            return await asyncio.gather(*(session(a, "u1", k) for k in range(3)),
                                        return_exceptions=True)
        finally:
            await a.close()

    got = asyncio.run(main())
    assert all(isinstance(e, InputError) for e in got)
    msg = str(got[0])
    assert "group 'u1' of train step 3 has 3 of 4 sessions after waiting 0.5 s" in msg
    assert "u1-0, u1-1, u1-2" in msg and "wait_timeout" in msg


def test_a_failed_session_releases_its_group_at_once(tmp_path):
    async def main():
        a = actor(tmp_path)   # no wait_timeout: only the failure ends the wait
        try:
            waiting = [asyncio.ensure_future(session(a, "u2", k)) for k in range(3)]
            await asyncio.sleep(0.2)
            assert not any(w.done() for w in waiting)
            await a.member_failed(3, "u2", 3, "RuntimeError: tool server down")
            return await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 10)
        finally:
            await a.close()

    got = asyncio.run(main())
    assert all(isinstance(e, InputError) for e in got)
    assert "its session 3 failed (RuntimeError: tool server down)" in str(got[0])


@pytest.mark.parametrize("size", [2, None])
def test_a_prompts_own_number_of_sessions_is_its_group(tmp_path, size):
    async def main():
        a = actor(tmp_path, wait_timeout=5 if size else 0.5)
        try:
            return await asyncio.gather(*(session(a, "u3", k, size=size) for k in range(2)),
                                        return_exceptions=True)
        finally:
            await a.close()

    got = asyncio.run(main())
    if size:   # two sessions make the group: both get advantages, one per response token
        assert all(g["values"].shape == (4,) for g in got)
        assert {g["source"] for g in got} <= {"draco", "fallback_outcome", "fallback_zero"}
    else:      # rollout.n (4) expected: the two wait, then fail naming the group
        assert all(isinstance(e, InputError) and "2 of 4 sessions" in str(e) for e in got)


def test_a_failed_group_is_forgotten_when_its_step_finishes(tmp_path):
    # verl drops a group with a failed session from the batch, so no finish names it: the actor
    # and its scorer forget it when the step's batch finishes, holding nothing of it after
    async def main():
        a = actor(tmp_path, wait_timeout=30)
        try:
            failing = [asyncio.ensure_future(session(a, "bad", k)) for k in range(3)]
            await asyncio.sleep(0.1)
            await a.member_failed(3, "bad", 3, "RuntimeError: env crashed")
            await asyncio.gather(*failing, return_exceptions=True)
            good = await asyncio.gather(*(session(a, "ok", k) for k in range(4)))
            metrics = await a.finish(3, ["ok"])
            scorer = await a._get()
            return good, metrics, dict(a._groups), dict(scorer._steps)
        finally:
            await a.close()

    good, metrics, groups, steps = asyncio.run(main())
    assert all(g["values"].shape == (4,) for g in good)
    assert metrics["draco/groups"] == 1.0
    assert groups == {} and steps == {}


def test_a_step_finished_in_two_batches_keeps_both_in_its_audit_folder(tmp_path):
    # verl's async V1 trains one generation step's groups in several batches: each finish
    # writes the step's audit folder, and a later one joins the earlier (it replaced it)
    async def main():
        a = actor(tmp_path, audit_dir=str(tmp_path / "audit"))
        try:
            await asyncio.gather(*(session(a, g, k) for g in ("ga", "gb") for k in range(4)))
            await a.finish(3, ["ga"])
            await a.finish(3, ["gb"])
        finally:
            await a.close()

    asyncio.run(main())
    folder = tmp_path / "audit" / "step-000003"
    rewards = pl.read_parquet(folder / "credit" / "rewards.parquet")
    assert sorted(rewards["group_id"].unique()) == ["ga", "gb"] and rewards.height == 8
    assert pl.read_parquet(folder / "rollouts.parquet").height == 8
    assert json.loads((folder / "metrics.json").read_text())["parts"] == 2
    got = run_draco("validate", str(folder))
    assert got.returncode == 0, got.stderr.decode()
