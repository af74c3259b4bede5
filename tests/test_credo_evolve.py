"""Rubric evolution with LLM-proposed edits against the local protocol server: the proposals
go through the real LLM layer (cached, costed under phase evolve), new criteria are judged,
features recomputed, and only an edit that lowers the held-out objective is accepted."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import polars as pl
import pytest

from draco_cli.credo import plan
from draco_cli.rubric.core import static_rubrics
from tests.conftest import REPO, run_draco
from tests.llm_server import schema_of, FakeLLMServer

sys.path.insert(0, str(REPO / "examples"))
from chain_env import ChainEnv, rollout_actions  # noqa: E402

KEY = "sk-test-planted-0123456789abcdefghij"
RIGHT = "Makes the right call"


def scripted(body: dict, i: int) -> str:
    system = body["messages"][0]["content"] + body["messages"][1]["content"]
    user = body["messages"][-1]["content"]
    if "maintain a grading rubric" in system:
        assert "untrusted data begins" in user and "measured" in user
        return json.dumps({"edits": [
            {"op": "add", "keys": [], "title": RIGHT,
             "requirement": "Every decision picks the right option.", "reason": "residuals"},
            {"op": "remove", "keys": ["c1"], "title": "", "requirement": "", "reason": "noise"},
            {"op": "merge", "keys": ["c9"], "title": "x", "requirement": "y", "reason": "bad"}]})
    # a judge: the new criterion fails an attempt with a wrong call, citing the wrong calls
    items = schema_of(body)["properties"]["verdicts"]["items"]
    ids = items["properties"]["criterion_id"]["enum"]
    acts = re.findall(r"### Step (\d+)\nAction:\ncall (right|wrong)", user)
    wrong = [int(s) for s, a in acts if a == "wrong"]
    right = [int(s) for s, a in acts if a == "right"]
    return json.dumps({"verdicts": [
        {"criterion_id": c, "verdict": "fail" if wrong else "pass",
         "cited_steps": wrong or right, "reason": "r"} for c in ids]})


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def world(tmp_path, n=160, seed=1):
    env = ChainEnv(theta=np.array([0.3, -0.2, 0.4, 0.1]))
    rng = np.random.default_rng(seed)
    ro, st, pos, truth = [], [], [], {}
    for i in range(n):
        acts, ret = rollout_actions(env, seed, i)
        rid = f"r{i}"
        ro.append({"rollout_id": rid, "group_id": f"g{i // 8}", "task_id": f"g{i // 8}",
                   "instruction": "Make four calls.", "outcome": ret, "n_turns": 4})
        for t, a in enumerate(acts):
            st.append({"rollout_id": rid, "step": t + 1,
                       "action": f"call {'right' if a else 'wrong'}", "observation": "ok",
                       "n_tokens": 3})
            pos.append({"rollout_id": rid, "step": t + 1, "prediction": 0.0, "error": 1.0,
                        "n_steps": env.T})
        truth[rid] = acts
    P = plan(pl.DataFrame(pos), budget=0.5 * sum(2 * (2 * (4 - p["step"]) + 1) for p in pos),
             seed=seed)
    labels = []
    for r in P.filter(pl.col("selected")).iter_rows(named=True):
        real, res = env.replay(truth[r["rollout_id"]], r["step"] - 1, 2, rng)
        labels += [{"rollout_id": r["rollout_id"], "step": r["step"], "side": s, "sample": k,
                    "return": v} for s, vals in (("realized", real), ("resampled", res))
                   for k, v in enumerate(vals)]
    rollouts = pl.DataFrame(ro)
    steps = pl.DataFrame(st, schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32})
    rubrics = static_rubrics(rollouts, [{"title": "Is polite",
                                         "requirement": "Every message is polite."}])
    verdicts = pl.DataFrame([{"rollout_id": r["rollout_id"], "criterion_id": c, "judge": "judge",
                              "verdict": "pass", "cited_steps": [1], "reason": "polite"}
                             for r in ro for c in rubrics.filter(
                                 pl.col("group_id") == r["group_id"])["criterion_id"]],
                            schema_overrides={"cited_steps": pl.List(pl.Int32)})
    for name, df in (("plan", P), ("labels", pl.DataFrame(labels)), ("rollouts", rollouts),
                     ("steps", steps), ("rubrics", rubrics), ("verdicts", verdicts)):
        df.write_parquet(tmp_path / f"{name}.parquet")
    return tmp_path


def propose_args(d, server):
    """``draco replay propose`` over the world in ``d``, against ``server``, into ``d/ev``."""
    return ["replay", "propose", *[x for n in ("plan", "labels", "rollouts", "steps", "rubrics",
                                               "verdicts")
                                   for x in (f"--{n}", str(d / f"{n}.parquet"))],
            "--model", "openai/judge-model", "--base-url", server.url + "/v1", "-o",
            str(d / "ev")]


def test_llm_proposed_edit_accepted_only_when_the_objective_drops(server, tmp_path):
    d = world(tmp_path)
    args = propose_args(d, server)
    res = run_draco(*args)
    assert res.returncode == 0, res.stderr.decode()
    scores = pl.read_parquet(d / "ev" / "evolve.parquet")
    base = scores.filter(pl.col("candidate") == "current rubric").row(0, named=True)
    add = scores.filter(pl.col("op") == "add").row(0, named=True)
    assert add["held_out_objective"] < base["held_out_objective"]
    assert add["accepted"] and scores["accepted"].sum() == 1
    # the all-pass rubric is filtered out entirely (no reward, no AUC); the new one separates
    # successes from failures
    assert base["outcome_auc"] is None and add["outcome_auc"] > 0.6
    assert {"held_out_mse", "outcome_auc"} <= set(scores.columns)
    bad = scores.filter(pl.col("op") == "merge").row(0, named=True)
    assert bad["error"] and "known key" in bad["error"] and not bad["accepted"]
    rb = pl.read_parquet(d / "ev" / "rubrics.parquet")
    assert set(rb["title"]) == {"Is polite", RIGHT}
    v = pl.read_parquet(d / "ev" / "verdicts.parquet")
    assert v["criterion_id"].n_unique() == rb["criterion_id"].n_unique()
    calls = [b["messages"][0]["content"] + b["messages"][1]["content"] for b in server.bodies]
    n_calls = len(calls)
    assert sum("maintain a grading rubric" in c for c in calls) == 1
    assert sum("maintain a grading rubric" not in c for c in calls) == 160  # one per rollout
    import sqlite3

    con = sqlite3.connect(d / "ev" / "llm_calls.sqlite")
    phases = dict(con.execute("SELECT phase, count(*) FROM calls GROUP BY phase").fetchall())
    con.close()
    assert phases == {"evolve": 161}                          # costed as candidate scoring
    # a rerun pays for nothing: every call comes from the log
    res = run_draco(*args, "--force")
    assert res.returncode == 0, res.stderr.decode()
    assert len(server.bodies) == n_calls
    assert pl.read_parquet(d / "ev" / "evolve.parquet").equals(scores)


def test_no_edit_accepted_when_none_helps(server, tmp_path, monkeypatch):
    d = world(tmp_path, n=80, seed=2)
    server.answer = lambda body, i: json.dumps({"edits": [
        {"op": "remove", "keys": ["c1"], "title": "", "requirement": "", "reason": "x"}]}) \
        if "maintain a grading rubric" in body["messages"][0]["content"] else scripted(body, i)
    res = run_draco(*propose_args(d, server))
    assert res.returncode == 0, res.stderr.decode()
    scores = pl.read_parquet(d / "ev" / "evolve.parquet")
    rm = scores.filter(pl.col("op") == "remove").row(0, named=True)
    base = scores.filter(pl.col("candidate") == "current rubric").row(0, named=True)
    assert rm["accepted"] == (rm["held_out_objective"] < base["held_out_objective"])
    if not rm["accepted"]:
        assert b"the rubric stays" in res.stderr
        assert pl.read_parquet(d / "ev" / "rubrics.parquet")["title"].to_list()[0] == "Is polite"


def test_no_label_in_the_held_out_tasks_is_refused_before_any_call(server, tmp_path):
    """With no replay label among the held-out tasks no edit can be scored: refused before
    the proposal is paid for, not when the scores are written."""
    from draco_cli.credo import task_split

    d = world(tmp_path, n=80, seed=3)
    _, held = task_split(pl.read_parquet(d / "rollouts.parquet"), 0.2)
    for name in ("plan", "labels"):   # the held-out tasks' positions were never planned
        pl.read_parquet(d / f"{name}.parquet").filter(
            ~pl.col("rollout_id").is_in(list(held))).write_parquet(d / f"{name}.parquet")
    res = run_draco(*propose_args(d, server))
    assert res.returncode == 1, res.stderr.decode()
    assert b"no selected position has both labels and features" in res.stderr
    assert server.bodies == [] and not (d / "ev" / "evolve.parquet").exists()
