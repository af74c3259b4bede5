"""verifiers 0.4.0 (its own Trace/Episode/MessageNode, built by its own graph code, saved and
read back by its own trace store) and draco: the in-loop group scoring behind the prime-rl
algorithm, ``draco ingest verifiers`` and ``draco export --to verifiers``. Every value lands on
its own sampled token (read back through verifiers' own ``Branch.advantages``), a length
mismatch and a swapped pair are refused, and "unassigned" (None) stays distinct from zero."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

vf = pytest.importorskip("verifiers.v1")

from verifiers.v1.task import WireTaskData  # noqa: E402
from verifiers.v1.utils.trace_store import read_episodes, write_episode  # noqa: E402

from draco_cli.errors import InputError  # noqa: E402
from draco_cli.inloop import StepScorer  # noqa: E402
from draco_cli.trainers.loader import AlignmentError, load_token_advantages  # noqa: E402
from draco_cli.trainers.prime_rl import DracoCredit  # noqa: E402
from draco_cli.trainers.verifiers import (assign_compact, check_trace, fill_trace,  # noqa: E402
                                          trace_tokens)
from tests.conftest import run_draco  # noqa: E402
from tests.llm_server import FakeLLMServer  # noqa: E402
from tests.test_rubric_judge import scripted  # noqa: E402
from tests.trainers.verifiers_traces import make_group, make_trace  # noqa: E402

GROUP = 4
TRACE = vf.Trace[WireTaskData, vf.State, vf.AgentConfig]


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted, latency=0.01).start()
    yield s
    s.stop()


def full_dense(trace, values: np.ndarray) -> list[float]:
    """draco's dense row widened to the whole branch (the prompt nodes before it read 0)."""
    tt = trace_tokens(trace)
    before = sum(len(n.token_ids) for n in trace.nodes[:tt.first])
    return [0.0] * before + np.asarray(values, dtype=np.float64).tolist()


async def score(server, tmp_path, groups, **kw):
    async with StepScorer("openai/m", base_url=server.url + "/v1", group_size=GROUP,
                          decode=decode, call_log=tmp_path / "calls.sqlite") as scorer:
        credit = DracoCredit(scorer, **kw)
        results = [await credit.score_group(g) for g in groups]
    return credit, results


@pytest.mark.parametrize("spans", [True, False], ids=["message-spans", "no-spans"])
def test_in_loop_each_trace_gets_its_own_values_on_its_sampled_tokens(server, tmp_path, spans):
    rng = np.random.default_rng(1)
    groups = [make_group(rng, task, GROUP, spans=spans) for task in range(3)]
    for g in groups:     # episodes arrive in completion order, not dispatch order
        rng.shuffle(g)
    credit, results = asyncio.run(score(server, tmp_path, groups))
    assert credit.short == 0 and all(r is not None for r in results)
    nonzero = 0
    for g, res in zip(groups, results):
        assert res is not None and res.train_step == 3
        for ep in g:
            trace = ep.traces[0]
            row = res.rows[trace.id]
            assert row.group_id == f"g{ep.traces[0].task.data.idx}"
            # verifiers' own spread of node.advantages onto the branch's tokens
            assert trace.branches[0].advantages == pytest.approx(full_dense(trace, row.values))
            for node in trace.nodes:
                if any(node.mask):
                    assert len(node.advantages) == sum(node.mask) == len(node.logprobs)
                else:
                    assert node.advantages is None   # never scored: not a zero
            nonzero += int(np.count_nonzero(row.values))
    assert nonzero > 0


def test_short_group_judged_as_its_survivors_skipped_or_refused(server, tmp_path):
    rng = np.random.default_rng(2)
    group = make_group(rng, 7, GROUP, errored=1)
    credit, results = asyncio.run(score(server, tmp_path, [group]))
    assert credit.short == 1 and len(results[0].rows) == GROUP - 1
    for ep in group:          # the errored trace: never scored, so unassigned (not zero)
        t = ep.traces[0]
        assert (t.branches[0].advantages is None) == (not t.ok)
    group = make_group(rng, 8, GROUP, errored=1)
    credit, results = asyncio.run(score(server, tmp_path, [group], short_groups="skip"))
    assert results == [None] and credit.short == 1
    for ep in group:
        assert all(n.advantages is None for n in ep.traces[0].nodes)
        assert ep.traces[0].branches[0].advantages is None
    with pytest.raises(InputError, match="3 trainable traces, group_size is 4"):
        asyncio.run(score(server, tmp_path, [make_group(rng, 9, GROUP, errored=1)],
                          short_groups="error"))


def test_fill_refuses_a_length_mismatch_a_swapped_pair_and_stray_values():
    rng = np.random.default_rng(3)
    a = make_trace(rng, 1, 2, lengths=(3, 4))
    b = make_trace(rng, 1, 2, lengths=(3, 4))
    ta = trace_tokens(a)
    dense = np.where(ta.mask == 1, 0.5, 0.0)
    with pytest.raises(AlignmentError, match="advantages of rollout .* given to trace"):
        fill_trace(b, a.id, dense)                   # a's row offered to b: refused by id
    with pytest.raises(AlignmentError, match="advantages for a response of"):
        fill_trace(a, a.id, dense[:-1])
    with pytest.raises(AlignmentError, match="its mask excludes"):
        fill_trace(a, a.id, np.full(len(ta.ids), 0.5))
    with pytest.raises(AlignmentError, match="6 advantages for 7 sampled tokens"):
        assign_compact(a, [0.1] * 6)
    assert all(n.advantages is None for n in a.nodes + b.nodes)   # nothing half-written
    assert fill_trace(a, a.id, dense) == [0.5] * 7


def write_records(path, groups) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for g in groups:
        for ep in g:
            write_episode(path, ep)      # verifiers' own writer: one Episode a line


def test_ingest_run_export_round_trip_on_verifiers_records(server, tmp_path):
    rng = np.random.default_rng(4)
    groups = [make_group(rng, task, GROUP) for task in range(2)]
    records = tmp_path / "rec"
    write_records(records, groups)
    res = run_draco("ingest", "verifiers", records / "traces.jsonl", "-o", tmp_path / "in")
    assert res.returncode == 0, res.stderr
    write_episode(records, make_group(rng, 9, 1)[0])     # a trace draco never scores
    res = run_draco("run", "--rollouts", tmp_path / "in" / "rollouts.parquet", "--steps",
                    tmp_path / "in" / "steps.parquet", "--model", "openai/m", "--base-url",
                    server.url + "/v1", "-o", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    out.mkdir()
    res = run_draco("export", "--to", "verifiers", "--advantages", tmp_path / "run",
                    "--records", records / "traces.jsonl", "-o", out / "traces.jsonl")
    assert res.returncode == 0, res.stderr
    assert b"1 traces not in the advantages file: left unassigned" in res.stderr
    table = load_token_advantages(tmp_path / "run" / "credit" / "token_advantages.parquet")
    back = {t.id: t for ep in read_episodes(out, TRACE) for t in ep.traces}
    assert len(back) == 2 * GROUP + 1
    nonzero = 0
    for tid, trace in back.items():
        if tid not in table:
            assert all(n.advantages is None for n in trace.nodes)
            assert trace.branches[0].advantages is None
            continue
        check_trace(trace)
        assert trace.branches[0].advantages == pytest.approx(full_dense(trace, table.get(tid)),
                                                             abs=0)
        nonzero += int(np.count_nonzero(table.get(tid)))
    assert nonzero > 0


def test_export_refuses_a_swapped_pair_and_a_length_mismatch(server, tmp_path):
    rng = np.random.default_rng(5)
    group = [vf.Episode(task=t.task, traces=[t], ok=True, group=vf.GroupInfo(id="g"),
                        run=vf.TrainRunInfo(id="r", work=vf.TrainWorkInfo(step=3)))
             for t in (make_trace(rng, 1, 2, lengths=(3, 4), reward=float(k % 2))
                       for k in range(GROUP))]
    records = tmp_path / "rec"
    write_records(records, [group])
    assert run_draco("ingest", "verifiers", records / "traces.jsonl", "-o",
                     tmp_path / "in").returncode == 0
    assert run_draco("run", "--rollouts", tmp_path / "in" / "rollouts.parquet", "--steps",
                     tmp_path / "in" / "steps.parquet", "--model", "openai/m", "--base-url",
                     server.url + "/v1", "-o", tmp_path / "run").returncode == 0
    lines = (records / "traces.jsonl").read_text().splitlines()
    a, b = json.loads(lines[0]), json.loads(lines[1])
    a["traces"][0]["id"], b["traces"][0]["id"] = b["traces"][0]["id"], a["traces"][0]["id"]
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("\n".join([json.dumps(a), json.dumps(b), *lines[2:]]) + "\n")
    res = run_draco("export", "--to", "verifiers", "--advantages", tmp_path / "run",
                    "--records", swapped, "-o", tmp_path / "x.jsonl")
    assert res.returncode != 0 and b"fingerprint" in res.stderr and b"row 1:" in res.stderr
    c = json.loads(lines[2])
    node = next(n for n in c["traces"][0]["nodes"] if any(n["mask"]))
    node["token_ids"].pop()
    node["mask"].pop()
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps(c) + "\n")
    res = run_draco("export", "--to", "verifiers", "--advantages", tmp_path / "run",
                    "--records", short, "-o", tmp_path / "x.jsonl")
    assert res.returncode != 0 and b"the file expects" in res.stderr
    assert b"Traceback" not in res.stderr and not (tmp_path / "x.jsonl").exists()


def test_ingest_positions_are_the_nodes_masks(tmp_path):
    rng = np.random.default_rng(6)
    group = make_group(rng, 2, 3, turns=(2, 4))
    write_records(tmp_path, [group, make_group(rng, 3, 1, tokens=False)])
    from draco_cli.ingest import ingest
    import polars as pl

    result = ingest("verifiers", [tmp_path / "traces.jsonl"], tmp_path / "in")
    assert result.rollouts == 3 and result.groups == 1
    assert result.warnings == ["1 traces without a sampled token were left out"]
    ro = pl.read_parquet(tmp_path / "in" / "rollouts.parquet")
    st = pl.read_parquet(tmp_path / "in" / "steps.parquet")
    for ep in group:
        trace = ep.traces[0]
        tt = trace_tokens(trace)
        row = ro.filter(pl.col("rollout_id") == trace.id)
        assert row["train_step"].item() == 3 and row["group_id"].item() == "g2"
        assert row["outcome"].item() == trace.reward
        spans = row["policy_spans"].item().to_list()
        assert [p for s, e in spans for p in range(s, e)] == np.flatnonzero(tt.mask).tolist()
        steps = st.filter(pl.col("rollout_id") == trace.id).sort("step")
        sampled = [n for n in trace.nodes if n.sampled]
        assert steps["action"].to_list() == [n.message.content for n in sampled]
        assert steps["n_tokens"].to_list() == [sum(n.mask) for n in sampled]
        assert steps["observation"].to_list()[:-1] == [
            f"observation {t}" for t in range(len(sampled) - 1)]


def test_bad_records_are_one_line_errors(tmp_path):
    rng = np.random.default_rng(7)
    write_records(tmp_path, [make_group(rng, 1, 2)])
    good = (tmp_path / "traces.jsonl").read_text().splitlines()
    rec = json.loads(good[1])
    node = next(n for n in rec["traces"][0]["nodes"] if any(n["mask"]))
    node["mask"].append(True)
    cases = {"notjson.jsonl": good[0] + "\n{oops\n",
             "mask.jsonl": good[0] + "\n" + json.dumps(rec) + "\n",
             "dup.jsonl": good[0] + "\n" + good[0] + "\n",
             "other.jsonl": '{"rows": []}\n'}
    said = {"notjson.jsonl": "row 2: not JSON", "mask.jsonl": "row 2: field 'nodes'",
            "dup.jsonl": "duplicate trace id", "other.jsonl": "not a verifiers episode"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        res = run_draco("ingest", "verifiers", tmp_path / name, "-o", tmp_path / name[:-6])
        err = res.stderr.decode()
        assert res.returncode != 0 and said[name] in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / name[:-6]).exists()
    res = run_draco("export", "--to", "verifiers", "--advantages", tmp_path, "-o",
                    tmp_path / "x.jsonl")
    assert res.returncode == 2 and b"needs --records" in res.stderr


def test_a_group_past_the_deadline_gets_the_counted_fallback_on_its_tokens(monkeypatch,
                                                                           tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    slow = FakeLLMServer(answer=scripted, latency=5.0).start()
    rng = np.random.default_rng(8)
    group = make_group(rng, 1, GROUP)
    for k, ep in enumerate(group):     # two solved, two not: the outcome GRPO is not all zero
        ep.traces[0].rewards = {"solved": vf.Reward(score=float(k % 2))}

    async def run():
        async with StepScorer("openai/m", base_url=slow.url + "/v1", group_size=GROUP,
                              decode=decode, call_log=tmp_path / "d.sqlite", deadline=0.5,
                              fallback="outcome") as scorer:
            return await DracoCredit(scorer).score_group(group)

    try:
        res = asyncio.run(run())
    finally:
        slow.stop()
    assert res is not None and res.metrics["draco/fallback_groups"] == 1
    o = np.array([ep.traces[0].reward for ep in group])
    want = (o - o.mean()) / (o.std(ddof=1) + 1e-6)
    for ep, a in zip(group, want):
        t = ep.traces[0]
        assert res.rows[t.id].source == "fallback:outcome"
        for node in t.nodes:
            if any(node.mask):
                np.testing.assert_allclose(node.advantages, a, rtol=1e-5)
            else:
                assert node.advantages is None


def test_a_two_branch_trace_is_read_node_by_node_and_each_branch_spreads_its_own():
    from verifiers.v1 import graph
    from verifiers.v1.types import AssistantMessage, Response, TurnTokens, UserMessage

    trace = make_trace(np.random.default_rng(9), 1, 2, lengths=(3, 2))
    # a compaction: the next request starts from a new prompt, so verifiers opens a new root
    prompt = [UserMessage(content="summary so far")]
    graph.prepare_turn(trace, prompt).commit(Response(
        id="c", created=0, model="policy", finish_reason="stop",
        message=AssistantMessage(content="resume"),
        tokens=TurnTokens(prompt_ids=[1, 2, 77, 78, 3], completion_ids=[91, 92, 93, 94],
                          completion_logprobs=[-0.1] * 4, message_spans=[(0, 4)])))
    assert trace.num_branches == 2
    tt = trace_tokens(trace)
    assert tt.n_sampled == 3 + 2 + 4
    dense = np.zeros(len(tt.ids))
    dense[tt.mask == 1] = np.arange(1, tt.n_sampled + 1)
    fill_trace(trace, trace.id, dense)
    assert [n.advantages for n in trace.nodes if any(n.mask)] == [[1, 2, 3], [4, 5],
                                                                  [6, 7, 8, 9]]
    for branch in trace.branches:   # verifiers' own per-branch view picks each node's values
        spread = np.asarray(branch.advantages)
        assert spread[np.asarray(branch.sampled_mask)].tolist() == [
            v for n in branch.nodes if any(n.mask) for v in n.advantages]
