"""Scoring inside the training step (draco_cli.inloop.step): rows from the trainer's token ids
and masks, each group judged as it completes, advantages by rollout id equal to the group's
own scoring, the deadline's fallback counted, a restarted trainer paying nothing twice."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import warnings

import numpy as np
import polars as pl
import pytest

from draco_cli.errors import InputError
from draco_cli.inloop.metrics import NoSignalWarning
from draco_cli.inloop import (BlockingStepScorer, Scorer, StepScorer, TrainerRollout,
                              trainer_rows, write_step)
from draco_cli.options import RunOptions
from draco_cli.trainers.loader import fingerprint, load_token_advantages
from tests.conftest import run_draco
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted

GROUP = 4


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def batch(n_groups: int = 3, seed: int = 0, step: int = 1) -> list[TrainerRollout]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        for k in range(GROUP):
            # turns: policy run, tool result, policy run, ... of random lengths
            mask: list[int] = []
            for t in range(int(rng.integers(1, 4))):
                mask += [1] * int(rng.integers(2, 9))
                if t < 2:
                    mask += [0] * int(rng.integers(1, 5))
            ids = rng.integers(0, 500, len(mask))
            out.append(TrainerRollout(f"s{step}-g{g}-{k}", f"s{step}-g{g}", f"solve task {g}",
                                      ids, mask, outcome=float(rng.integers(0, 2)),
                                      train_step=step, row=len(out)))
    return out


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted, latency=0.05).start()
    yield s
    s.stop()


def calls(log) -> int:
    con = sqlite3.connect(log)
    try:
        return con.execute("select count(*) from calls").fetchone()[0]
    finally:
        con.close()


def test_rows_are_the_runs_of_policy_tokens():
    r = TrainerRollout("a", "g", "task", [5, 6, 7, 8, 9, 10, 11], [1, 1, 0, 0, 1, 0, 1])
    ro, st = trainer_rows([r], decode)
    assert ro["policy_spans"].to_list() == [[[0, 2], [4, 5], [6, 7]]]
    assert ro["response_len"].item() == 7 and ro["n_turns"].item() == 3
    assert ro["response_fingerprint"].item() == fingerprint([5, 6, 7, 8, 9, 10, 11])
    assert st.select("step", "token_start", "n_tokens").rows() == [(1, 0, 2), (2, 4, 1),
                                                                    (3, 6, 1)]
    assert st["action"].to_list() == ["w5 w6", "w9", "w11"]
    assert st["observation"].to_list() == ["w7 w8", "w10", ""]


@pytest.mark.parametrize(("ids", "mask", "said"), [
    ([1, 2, 3], [1, 1], "response_mask has 2 entries but response_ids 3"),
    ([1, 2], [0, 0], "no policy tokens"),
    ([1, 2], [1, 2], "values other than 0 and 1"),
])
def test_bad_rows_name_the_trainer_row(ids, mask, said):
    r = TrainerRollout("r7", "g", "t", ids, mask, row=7)
    with pytest.raises(InputError, match=said) as e:
        trainer_rows([r], decode)
    assert "trainer row 7 (rollout 'r7'" in str(e.value)


def test_step_rows_equal_the_groups_own_scoring(server, tmp_path):
    rollouts = batch()

    async def main():
        async with StepScorer("openai/gpt-4.1", base_url=server.url + "/v1", group_size=GROUP,
                              decode=decode, call_log=tmp_path / "a.sqlite") as s:
            return await s.score_step(rollouts, 1)

    started = time.monotonic()
    res = asyncio.run(main())
    assert not res.fallbacks and len(res.rows) == len(rollouts)
    # the same groups through Scorer.score_group on the same rows, on a log of its own
    ro, st = trainer_rows(rollouts, decode)
    opts = RunOptions()
    opts = opts.model_copy(update={"credit": opts.credit.model_copy(update={"tokens": "dense"})})

    async def direct():
        async with Scorer("openai/m", base_url=server.url + "/v1", options=opts,
                          call_log=tmp_path / "b.sqlite") as s:
            return await asyncio.gather(*(s.score_group(
                ro.filter(pl.col("group_id") == g),
                st.filter(pl.col("rollout_id").str.starts_with(g + "-")))
                for g in ro["group_id"].unique(maintain_order=True)))

    want = {}
    for g in asyncio.run(direct()):
        want.update(zip(g.token_advantages["rollout_id"], g.token_advantages["advantages"]))
    nonzero = 0
    for r in rollouts:
        row = res.rows[r.rollout_id]
        assert row.source == "draco" and row.values.dtype == np.float32
        assert row.values.shape == (len(r.response_ids),)
        np.testing.assert_array_equal(row.values, np.asarray(want[r.rollout_id], np.float32))
        assert not row.values[np.asarray(r.response_mask) == 0].any()  # observations get 0
        nonzero += bool(row.values.any())
    m = res.metrics
    assert m["draco/rollouts"] == len(rollouts) and m["draco/groups"] == 3
    assert m["draco/judge_calls"] == calls(tmp_path / "a.sqlite") > 0
    assert m["draco/nonzero_share"] == nonzero / len(rollouts) > 0
    assert m["draco/signal_ok"] == 1.0 and m["draco/fallback_groups"] == 0
    assert 0 < m["draco/criteria_kept"] <= m["draco/criteria_total"]
    # every answer was new, and each is a call-log row with its dollars (gpt-4.1's list price)
    with sqlite3.connect(tmp_path / "a.sqlite") as conn:
        logged = conn.execute("SELECT count(*), sum(cost_usd) FROM calls WHERE status = 'ok'"
                              ).fetchone()
    assert m["draco/unanswered_share"] == 0.0 and m["draco/cached_calls"] == 0
    assert m["draco/cost_usd"] == pytest.approx(logged[1]) and logged[1] > 0
    modes = {}
    for r in res.rows.values():
        modes[r.credit_mode] = modes.get(r.credit_mode, 0) + 1
    assert {k.split("/")[-1]: v for k, v in m.items() if k.startswith("draco/credit_mode/")} \
        == {k: v / len(rollouts) for k, v in modes.items()}
    assert 0 <= m["draco/seconds_to_advantages"] <= time.monotonic() - started
    # the audit files: draco run's layout, loadable by the trainers' loader
    folder = write_step(res, tmp_path / "steps")
    table = load_token_advantages(folder / "credit" / "token_advantages.parquet")
    np.testing.assert_array_equal(table.get(rollouts[0].rollout_id),
                                  res.rows[rollouts[0].rollout_id].values)
    # and what `draco report` reads: the steps as judged beside their credit
    got = run_draco("report", str(tmp_path / "steps"), "-o", str(tmp_path / "r.html"))
    assert got.returncode == 0, got.stderr.decode()
    html = (tmp_path / "r.html").read_text()
    assert rollouts[0].rollout_id in html and "step 1" in html


@pytest.mark.parametrize("order", ["same", "reversed"])
def test_a_restarted_trainer_pays_nothing_twice(server, tmp_path, order):
    """Also when its sessions finish in another order (verl's workers, async rollouts): the
    group's requests must not follow it. The rubric's union prompt lists the group's attempts;
    in arrival order, the verl in-loop test's reference scorer (rows in batch order) missed
    the actor's union calls, and a restarted trainer would ask them, and pay, again."""
    log = tmp_path / "calls.sqlite"
    with BlockingStepScorer("openai/m", base_url=server.url + "/v1", group_size=GROUP,
                            decode=decode, call_log=log) as s:
        first = s.score_step(batch(), 1)
    paid = sum(server.hits.values())
    rerun = batch() if order == "same" else batch()[::-1]   # every group's members reversed
    with BlockingStepScorer("openai/m", base_url=server.url + "/v1", group_size=GROUP,
                            decode=decode, call_log=log) as s:
        again = s.score_step(rerun, 1)
    assert sum(server.hits.values()) == paid          # not one request reached the server
    assert again.metrics["draco/judge_calls"] == 0
    assert again.metrics["draco/cached_calls"] == first.metrics["draco/judge_calls"] > 0
    for k, row in first.rows.items():
        np.testing.assert_array_equal(row.values, again.rows[k].values)


def test_groups_start_judging_while_others_generate(server, tmp_path):
    rollouts = batch(n_groups=2)

    async def main():
        async with StepScorer("openai/m", base_url=server.url + "/v1", group_size=GROUP,
                              decode=decode, call_log=tmp_path / "c.sqlite") as s:
            for r in rollouts[:GROUP]:
                await s.add(r)
            first = await s.advantages(rollouts[0].rollout_id, 1)   # group 1 alone
            hits_before_second = sum(server.hits.values())
            for r in rollouts[GROUP:]:
                await s.add(r)
            return first, hits_before_second, await s.finish(1)

    first, hits, res = asyncio.run(main())
    assert hits > 0 and first.source == "draco"
    np.testing.assert_array_equal(first.values, res.rows[rollouts[0].rollout_id].values)


def test_finish_some_groups_leaves_the_others_pending(server, tmp_path):
    """An async trainer's batch holds part of a generation step: finishing those groups gives
    their rows and metrics only; the step's other groups finish later."""
    rollouts = batch(n_groups=3)

    async def main():
        async with StepScorer("openai/m", base_url=server.url + "/v1", group_size=GROUP,
                              decode=decode, call_log=tmp_path / "c.sqlite") as s:
            for r in rollouts[:2 * GROUP + 1]:
                await s.add(r)
            part = await s.finish(1, groups=["s1-g1"])
            with pytest.raises(InputError, match="group 'nope': no rollout of it"):
                await s.finish(1, groups=["nope"])
            for r in rollouts[2 * GROUP + 1:]:
                await s.add(r)
            return part, await s.finish(1)

    part, rest = asyncio.run(main())
    assert sorted(part.rows) == [f"s1-g1-{k}" for k in range(GROUP)]
    assert part.metrics["draco/rollouts"] == GROUP and part.metrics["draco/groups"] == 1
    assert sorted(rest.rows) == sorted(r.rollout_id for r in rollouts
                                       if r.group_id != "s1-g1")


def test_deadline_falls_back_to_outcome_grpo_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    slow = FakeLLMServer(answer=scripted, latency=5.0).start()
    try:
        rollouts = batch(n_groups=2)
        t0 = time.monotonic()
        with BlockingStepScorer("openai/m", base_url=slow.url + "/v1", group_size=GROUP,
                                decode=decode, call_log=tmp_path / "d.sqlite",
                                deadline=0.5, fallback="outcome") as s:
            res = s.score_step(rollouts, 1)
        assert time.monotonic() - t0 < 4.0
    finally:
        slow.stop()
    assert set(res.fallbacks) == {"s1-g0", "s1-g1"}
    assert "deadline (0.5 s)" in res.fallbacks["s1-g0"]
    assert res.metrics["draco/fallback_groups"] == 2
    assert res.metrics["draco/fallback_rollouts"] == len(rollouts)
    for g in ("s1-g0", "s1-g1"):
        members = [r for r in rollouts if r.group_id == g]
        o = np.array([r.outcome for r in members])
        want = (o - o.mean()) / (o.std(ddof=1) + 1e-6) if o.std() else np.zeros_like(o)
        for r, a in zip(members, want):
            row = res.rows[r.rollout_id]
            assert row.source == "fallback:outcome"
            mask = np.asarray(r.response_mask) == 1
            np.testing.assert_allclose(row.values[mask], a, rtol=1e-5, atol=1e-6)
            assert not row.values[~mask].any()


def test_zero_fallback_and_a_group_short_of_members(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    slow = FakeLLMServer(answer=scripted, latency=5.0).start()
    try:
        with BlockingStepScorer("openai/m", base_url=slow.url + "/v1", group_size=GROUP,
                                decode=decode, call_log=tmp_path / "e.sqlite",
                                deadline=0.3, fallback="zero") as s:
            with pytest.warns(NoSignalWarning, match=r"train step 1: no rollout of 4 has a "
                                                     r"non-zero advantage"):
                res = s.score_step(batch(n_groups=1), 1)
            assert all(r.source == "fallback:zero" and not r.values.any()
                       for r in res.rows.values())
            assert res.metrics["draco/signal_ok"] == 0.0
            with warnings.catch_warnings():   # said once per scorer
                warnings.simplefilter("error", NoSignalWarning)
                assert not s.score_step(batch(n_groups=1, step=2), 2).metrics["draco/signal_ok"]
            with pytest.raises(InputError, match=r"group 's1-g0': 3 of 4 rollouts finished "
                                                 r"by the end of step 1") as e:
                s.score_step(batch(n_groups=1)[:3], 1)
            # each rollout it has, by its trainer row
            assert "s1-g0-0 (trainer row 0), s1-g0-1 (trainer row 1)" in str(e.value)
    finally:
        slow.stop()


def test_a_session_waits_for_the_rest_of_its_group(server, tmp_path):
    rollouts = batch(n_groups=1)

    async def main():
        async with StepScorer("openai/m", base_url=server.url + "/v1", group_size=GROUP,
                              decode=decode, call_log=tmp_path / "f.sqlite") as s:
            async def session(k, r):
                await asyncio.sleep(0.05 * k)
                await s.add(r)
                return await s.advantages(r.rollout_id, 1)   # before the others finish

            rows = await asyncio.gather(*(session(k, r) for k, r in enumerate(rollouts)))
            return rows, await s.finish(1)

    rows, res = asyncio.run(main())
    assert [r.rollout_id for r in rows] == [r.rollout_id for r in rollouts]
    assert all(r.source == "draco" for r in rows) and len(res.rows) == GROUP


def test_step_folders_are_what_draco_report_and_validate_read(tmp_path):
    """A training run's step folders (``write_step``, every hook's audit_dir) hold whole
    contract tables and a manifest: `draco report` over several shows the trend over steps,
    `draco validate` passes each."""
    with BlockingStepScorer("mock/judge", group_size=GROUP, decode=decode,
                            call_log=tmp_path / "log.sqlite") as s:
        folders = [write_step(s.score_step(batch(seed=k, step=k), k), tmp_path / "steps",
                              keep=5) for k in (1, 2)]
    got = run_draco("report", str(tmp_path / "steps"), "-o", str(tmp_path / "r.html"))
    assert got.returncode == 0, got.stderr.decode()
    html = (tmp_path / "r.html").read_text()
    assert "step 1" in html and "step 2" in html and "pass^k over training steps" in html
    for folder in folders:
        got = run_draco("validate", str(folder))
        assert got.returncode == 0, got.stderr.decode()
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["kind"] == "draco in-loop step" and "health" in manifest
        assert manifest["settings"] == {"setting": "draco", "model": "mock/judge"}


@pytest.mark.parametrize("how", ["exit", "deadline", "discard"])
def test_no_judge_call_outlives_the_scorer(monkeypatch, tmp_path, how):
    # a call still in flight when the scorer closes (a group judged when the trainer stops, one
    # past its deadline, one discarded) is cancelled and unwound by __aexit__, not left for the
    # trainer's loop to find half-finished, or to die with it when the loop closes
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    slow = FakeLLMServer(answer=scripted, latency=2.0).start()

    async def main():
        async with StepScorer("openai/m", base_url=slow.url + "/v1", group_size=GROUP,
                              decode=decode, call_log=tmp_path / "o.sqlite",
                              deadline=0.3 if how == "deadline" else None) as s:
            for r in batch(n_groups=1):
                await s.add(r)
            await asyncio.sleep(0.2)    # the group's first call is on the wire
            if how == "deadline":
                await s.finish(1)
            elif how == "discard":
                s.discard(1)
        return asyncio.all_tasks() - {asyncio.current_task()}

    try:
        t0 = time.monotonic()
        left = asyncio.run(main())
        assert time.monotonic() - t0 < 1.5
    finally:
        slow.stop()
    assert left == set()
