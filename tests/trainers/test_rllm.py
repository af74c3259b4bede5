"""The rLLM adapter: draco's advantages on every ``Step.advantage``, checked against rLLM's
structures (a contract of commit 9beb6e0f; rLLM's own code too when DRACO_RLLM_SRC names a
snapshot, see tests/trainers/rllm_structures.py): every value on its step's own tokens, a
length or identity mismatch refused by name, "not assigned" kept as None, and the offline
path (ingest → draco run → export) landing on the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from draco_cli.errors import InputError
from draco_cli.inloop import BlockingStepScorer
from draco_cli.trainers.rllm import (DracoGroupingHook, apply_advantages, layout_of,
                                     plan_groups)
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.trainers.rllm_structures import RLLM_SRC, structures, make_episodes

N = 4
KINDS = ["contract", pytest.param("real", marks=pytest.mark.skipif(
    not RLLM_SRC, reason="DRACO_RLLM_SRC (a snapshot of rllm-org/rllm) not set"))]


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def server():
    s = FakeLLMServer(answer=scripted, latency=0.0).start()
    yield s
    s.stop()


@pytest.fixture
def scorer(server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    with BlockingStepScorer("openai/m", base_url=server.url + "/v1", group_size=N,
                            decode=decode, call_log=tmp_path / "calls.sqlite") as s:
        yield s


@pytest.mark.parametrize("kind", KINDS)
def test_hook_puts_each_rollouts_values_on_its_own_steps(kind, scorer):
    rl = structures(kind)
    episodes = make_episodes(rl, np.random.default_rng(1), tasks=3, n=N)
    rng = np.random.default_rng(2)
    episodes = [episodes[i] for i in rng.permutation(len(episodes))]  # finished in any order
    hook = DracoGroupingHook(scorer, rl.grouping, first_step=5)
    groups = rl.transform(episodes, hook)
    assert hook.train_step == 6 and hook.last is not None
    rows = hook.last.rows
    nonzero = 0
    for group in groups:
        flat = rl.precomputed(group)     # what rLLM trains on
        want: list[float] = []
        for traj in group.trajectories:
            lay = layout_of(traj)
            dense = rows[traj.uid].values
            assert len(dense) == len(lay.response_ids)
            assert not dense[lay.response_mask == 0].any()   # observations carry nothing
            for step, (s, e) in zip(traj.steps, lay.spans):
                assert isinstance(step.advantage, list)
                assert len(step.advantage) == len(step.response_ids) == e - s
                np.testing.assert_array_equal(np.float32(step.advantage), dense[s:e])
                want += step.advantage
            nonzero += int(np.count_nonzero(dense))
        np.testing.assert_array_equal(np.float32(flat), np.float32(want))
    assert nonzero > 0     # the judge's verdicts reached the tokens


@pytest.mark.parametrize("kind", KINDS)
def test_context_reset_keeps_every_step_on_its_tokens(kind, scorer):
    rl = structures(kind)
    episodes = make_episodes(rl, np.random.default_rng(3), tasks=1, n=N, reset_at=1)
    groups = rl.transform(episodes, DracoGroupingHook(scorer, rl.grouping))
    for traj in groups[0].trajectories:
        assert [len(s.advantage) for s in traj.steps] == [len(s.response_ids)
                                                          for s in traj.steps]


def _scored(rl, scorer, seed=4):
    groups = rl.grouping(make_episodes(rl, np.random.default_rng(seed), tasks=2, n=N),
                         rl.config, None)
    planned = plan_groups(groups, group_size=N, decode=decode, train_step=1)
    result = scorer.score_step([p.rollout for p in planned], 1)
    return groups, planned, result


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_whose_length_changed_is_refused_not_zeroed(kind, scorer):
    rl = structures(kind)
    groups, planned, result = _scored(rl, scorer)
    traj = groups[1].trajectories[2]
    traj.steps[-1].response_ids = traj.steps[-1].response_ids[:-1]
    with pytest.raises(InputError, match=rf"trajectory '{traj.uid}' step {len(traj.steps)} "
                       r"\(id '.*'\): has \d+ response tokens, draco scored \d+ \(rLLM "
                       "would zero"):
        apply_advantages(planned, result)
    # whole or nothing: no step of any trajectory was set
    assert all(s.advantage is None for g in groups for t in g.trajectories for s in t.steps)


@pytest.mark.parametrize("kind", KINDS)
def test_swapped_pairs_are_refused(kind, scorer):
    rl = structures(kind)
    groups, planned, result = _scored(rl, scorer)
    a, b = groups[0].trajectories[0], groups[0].trajectories[1]
    a.steps[0].response_ids, b.steps[0].response_ids = (b.steps[0].response_ids,
                                                        a.steps[0].response_ids)
    with pytest.raises(InputError, match="response tokens, draco scored|token ids differ"):
        apply_advantages(planned, result)
    # two steps of one trajectory swapped: named by the step id draco scored there
    groups, planned, result = _scored(rl, scorer, seed=5)
    traj = next(t for g in groups for t in g.trajectories if len(t.steps) >= 2)
    traj.steps[0], traj.steps[1] = traj.steps[1], traj.steps[0]
    with pytest.raises(InputError, match="steps reordered or swapped"):
        apply_advantages(planned, result)


@pytest.mark.parametrize("kind", KINDS)
def test_unscored_calls_keep_none_and_a_wrong_group_size_is_named(kind, scorer):
    rl = structures(kind)
    episodes = make_episodes(rl, np.random.default_rng(6), tasks=1, n=N)
    hook = DracoGroupingHook(scorer, rl.grouping, score=lambda eps: False)   # validation
    groups = rl.transform(episodes, hook)
    assert hook.train_step == 0 and hook.last is None
    assert all(s.advantage is None for t in groups[0].trajectories for s in t.steps)
    with pytest.raises(InputError, match=r"TrajectoryGroup 'task0:solver': 3 trajectories, "
                       "the scorer's group_size is 4"):
        rl.transform(episodes[:3], DracoGroupingHook(scorer, rl.grouping))


def _draco(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENAI_API_KEY": "sk-test-api-0000000000000"}
    return subprocess.run([sys.executable, "-m", "draco_cli", *args], cwd=cwd,
                          capture_output=True, text=True, env=env)


@pytest.mark.process
@pytest.mark.parametrize("kind", KINDS)
def test_ingest_run_export_lands_on_rllms_tokens(kind, server, tmp_path):
    rl = structures(kind)
    episodes = make_episodes(rl, np.random.default_rng(7), tasks=2, n=N)
    folder = tmp_path / "episodes"          # rllm eval --save-episodes' layout
    folder.mkdir()
    for i, ep in enumerate(episodes):
        (folder / f"episode_{i:06d}_{ep.id.split(':')[0]}.json").write_text(
            json.dumps(ep.model_dump(mode="json"), indent=2))
    res = _draco("ingest", "rllm", str(folder), "-o", "data", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = _draco("run", "--rollouts", "data/rollouts.parquet", "--steps", "data/steps.parquet",
                 "--model", "openai/m", "--base-url", server.url + "/v1", "-o", "run",
                 cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    table_path = tmp_path / "run" / "credit" / "token_advantages.parquet"
    res = _draco("export", "--to", "rllm", "--advantages", "run", "--records", str(folder),
                 "-o", "out.jsonl", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    from draco_cli.trainers.loader import load_token_advantages

    table = load_token_advantages(table_path)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == len(episodes)
    assert any(np.count_nonzero(table.get(t.uid)) for e in episodes for t in e.trajectories)
    for line, ep in zip(lines, episodes):
        got = json.loads(line)
        traj = got["trajectories"][0]
        lay = layout_of(ep.trajectories[0])
        dense = table.get(lay.rollout_id)
        for step, (s, e) in zip(traj["steps"], lay.spans):
            np.testing.assert_array_equal(np.float32(step["advantage"]), dense[s:e])
        meta = traj.get("info") or traj["metadata"]
        assert meta["draco"]["response_fingerprint"] == lay.fingerprint
        if rl.kind == "real":     # rLLM reads the file back with its own loader
            back = rl.Episode.model_validate(got)
            assert [s.advantage for s in back.trajectories[0].steps] == \
                [st["advantage"] for st in traj["steps"]]
    # records that are not the scored rollouts are refused, nothing written
    other = make_episodes(rl, np.random.default_rng(8), tasks=1, n=1)[0]
    bad = other.model_dump(mode="json")
    bad["trajectories"][0]["uid"] = episodes[0].trajectories[0].uid
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    res = _draco("export", "--to", "rllm", "--advantages", "run", "--records", "bad.json",
                 "-o", "bad.jsonl", cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "not the rollouts the advantages were computed for" in res.stderr
    assert not (tmp_path / "bad.jsonl").exists()


def test_records_without_token_ids_are_refused_by_name(tmp_path):
    ep = {"id": "t:0", "trajectories": [{"uid": "u1", "name": "a", "steps": [
        {"model_response": "hi", "chat_completions": []}]}]}
    (tmp_path / "e.jsonl").write_text(json.dumps(ep) + "\n")
    from draco_cli.ingest import ingest

    with pytest.raises(InputError, match=r"e.jsonl: line 1 trajectory 0: field 'response_ids': trajectory 'u1': "
                       "no response token ids"):
        ingest("rllm", [tmp_path / "e.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out" / "rollouts.parquet").exists()


@pytest.mark.skipif(not RLLM_SRC, reason="DRACO_RLLM_SRC (a snapshot of rllm-org/rllm) not set")
def test_the_contract_rule_is_rllms_own():
    """rLLM's _collect_precomputed_advantages and the contract agree: a float spread, a list
    kept, a list of the wrong length silently zeroed (why draco refuses one), None refused."""
    from tests.trainers.rllm_structures import contract_precomputed

    rl = structures("real")
    group = rl.grouping(make_episodes(rl, np.random.default_rng(9), tasks=1, n=3), rl.config,
                        None)[0]
    a, b, c = group.trajectories
    for s in a.steps:
        s.advantage = 0.5
    for s in b.steps:
        s.advantage = [0.25] * len(s.response_ids)
    for s in c.steps:
        s.advantage = [1.0] * (len(s.response_ids) + 1)
    want = contract_precomputed(group)
    assert rl.precomputed(group) == want
    assert want[-len(c.steps[-1].response_ids):] == [0.0] * len(c.steps[-1].response_ids)
    a.steps[0].advantage = None
    with pytest.raises(ValueError, match="scalar or a list"):
        rl.precomputed(group)
    with pytest.raises(ValueError, match="scalar or a list"):
        contract_precomputed(group)


def test_the_algorithm_config_must_take_precomputed_advantages(scorer):
    from types import SimpleNamespace

    from draco_cli.errors import UsageError
    from draco_cli.trainers.rllm import check_algorithm_config

    check_algorithm_config({"use_precomputed_advantage": True})
    with pytest.raises(UsageError, match="use_precomputed_advantage must be true"):
        DracoGroupingHook(scorer, lambda *a: [],
                          algorithm_config=SimpleNamespace(use_precomputed_advantage=False))


def test_ingest_decodes_with_the_policys_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    import polars as pl

    from draco_cli.ingest import ingest

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rl = structures("contract")
    episodes = make_episodes(rl, np.random.default_rng(10), tasks=1, n=2)
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(e.model_dump(mode="json")) + "\n"
                                              for e in episodes))
    res = ingest("rllm", [tmp_path / "e.jsonl"], tmp_path / "out",
                 tokenizer=str(tmp_path / "tokenizer.json"), train_step=3)
    assert res.rollouts == 2 and res.groups == 1
    steps = pl.read_parquet(tmp_path / "out" / "steps.parquet")
    rollouts = pl.read_parquet(tmp_path / "out" / "rollouts.parquet")
    assert rollouts["train_step"].to_list() == [3, 3]
    for ep in episodes:
        traj = ep.trajectories[0]
        got = steps.filter(pl.col("rollout_id") == traj.uid).sort("step")
        assert got["action"].to_list() == [" ".join(f"w{i}" for i in s.response_ids)
                                           for s in traj.steps]
        assert got["token_start"].to_list() == [s for s, _ in layout_of(traj).spans]


@pytest.mark.parametrize("kind", KINDS)
def test_hook_called_from_the_trainers_event_loop(kind, scorer):
    """UnifiedTrainer calls the grouping hook from its async step."""
    import asyncio

    rl = structures(kind)
    episodes = make_episodes(rl, np.random.default_rng(11), tasks=1, n=N)

    async def step():
        return rl.transform(episodes, DracoGroupingHook(scorer, rl.grouping))

    groups = asyncio.run(step())
    assert all(isinstance(s.advantage, list) for t in groups[0].trajectories for s in t.steps)


@pytest.mark.process
@pytest.mark.skipif(not RLLM_SRC, reason="DRACO_RLLM_SRC (a snapshot of rllm-org/rllm) not set")
def test_to_dict_records_round_trip_through_rllms_from_dict(server, tmp_path):
    """Episode.to_dict() files (no Step.id) in, Episode.from_dict reading the export back: the
    values on each step, None on a trajectory the run did not score."""
    rl = structures("real")
    episodes = make_episodes(rl, np.random.default_rng(12), tasks=2, n=N)
    (tmp_path / "eps.jsonl").write_text("".join(json.dumps(e.to_dict()) + "\n"
                                                for e in episodes))
    assert _draco("ingest", "rllm", "eps.jsonl", "-o", "data", cwd=tmp_path).returncode == 0
    res = _draco("run", "--rollouts", "data/rollouts.parquet", "--steps", "data/steps.parquet",
                 "--model", "openai/m", "--base-url", server.url + "/v1", "-o", "run",
                 cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    extra = make_episodes(rl, np.random.default_rng(13), tasks=1, n=1)[0]   # not scored
    with (tmp_path / "eps.jsonl").open("a") as f:
        f.write(json.dumps(extra.to_dict()) + "\n")
    res = _draco("export", "--to", "rllm", "--advantages", "run", "--records", "eps.jsonl",
                 "-o", "out.jsonl", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "1 trajectories have no draco advantages" in res.stderr
    from draco_cli.trainers.loader import load_token_advantages

    table = load_token_advantages(tmp_path / "run/credit/token_advantages.parquet")
    back = [rl.Episode.from_dict(json.loads(line))
            for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for ep, got in zip(episodes, back):
        lay = layout_of(ep.trajectories[0])
        traj = got.trajectories[0]
        assert traj.info["draco"]["response_fingerprint"] == lay.fingerprint
        for step, (s, e) in zip(traj.steps, lay.spans):
            np.testing.assert_array_equal(np.float32(step.advantage),
                                          table.get(lay.rollout_id)[s:e])
    assert all(s.advantage is None for s in back[-1].trajectories[0].steps)


@pytest.mark.parametrize("kind", KINDS)
def test_episode_credit_judges_each_group_as_it_completes(kind, server, tmp_path,
                                                          monkeypatch):
    import asyncio

    from draco_cli.inloop import StepScorer
    from draco_cli.trainers.rllm import EpisodeCredit

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    rl = structures(kind)
    episodes = make_episodes(rl, np.random.default_rng(14), tasks=2, n=N)
    first, second = episodes[:N], episodes[N:]

    async def main():
        async with StepScorer("openai/m", base_url=server.url + "/v1", group_size=N,
                              decode=decode, call_log=tmp_path / "c.sqlite") as s:
            credit = EpisodeCredit(s, train_step=2)
            for ep in reversed(first):
                await credit.add(ep)
            # task0's group is judged while task1 has not started
            await asyncio.wait_for(asyncio.gather(*(credit.assign(ep) for ep in first)), 60)
            assert all(st.advantage is None for ep in second
                       for st in ep.trajectories[0].steps)
            for ep in second:
                await credit.add(ep)
            await asyncio.gather(*(credit.assign(ep) for ep in second))
            return await credit.finish()

    result = asyncio.run(main())
    assert len(result.rows) == 2 * N and result.train_step == 2
    for ep in episodes:
        traj = ep.trajectories[0]
        lay = layout_of(traj)
        for st, (s, e) in zip(traj.steps, lay.spans):
            np.testing.assert_array_equal(np.float32(st.advantage),
                                          result.rows[traj.uid].values[s:e])
