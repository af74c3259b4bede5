"""The agent's policy reaches the rubric writer and the judge as task context (issue 31): on
tau-bench the task shown is the user simulator's instruction, so "followed the cancellation
policy" was judged without the policy. It opens the user message (same bytes for every request
of the run, so a provider caches it as a prefix)."""

from __future__ import annotations

import json

import polars as pl
import pytest

from draco_cli.ingest import ingest
from draco_cli.judge.core import score_stage
from draco_cli.llm.types import Sampling
from draco_cli.prompts.render import RenderOptions
from draco_cli.redact import Redactor
from draco_cli.rubric.core import merge_request, stage_requests
from tests.conftest import TAU, TAU2
from tests.tau2_telecom import POLICY, results


def _requests(stage):
    return next(stage)  # the first request list a stage yields


def _user_texts(reqs):
    return [next(m["content"] for m in r.messages if m["role"] == "user") for r in reqs]


def _check_prompts(rollouts, steps, policy_head):
    render = RenderOptions(redactor=Redactor())
    rubric = stage_requests(rollouts, steps, ("generate", "union"), 8, render, Sampling())
    texts = _user_texts([j[3] for j in rubric])
    crit = pl.DataFrame({"group_id": rollouts["group_id"].unique().to_list()}).with_columns(
        criterion_id=pl.lit("c1"), title=pl.lit("Follows the policy"),
        requirement=pl.lit("The agent follows its policy."), source=pl.lit("merge"))
    judge = score_stage(rollouts, steps, crit)
    stream = _requests(judge)
    texts += _user_texts(list(stream))
    merge = merge_request("g", "do it", [{"title": "t", "requirement": "r"}], 8, render,
                          Sampling(), "")
    assert not merge.messages[1]["content"].startswith("The agent's own")
    assert len(texts) > rollouts.height
    for t in texts:
        assert policy_head in t
        # the policy is the prefix: before the task, the criteria and any rollout text
        assert t.index(policy_head) < min(t.index(w) for w in ("Task:",) if w in t)
        assert t.startswith("The agent's own instructions")
    prefix = texts[0][: texts[0].index("Task:") if "Task:" in texts[0] else 0]
    assert all(t.startswith(prefix.split("<<<")[0]) for t in texts)


def test_tau2_policy_is_task_context(tmp_path):
    path = tmp_path / "telecom.json"
    path.write_text(json.dumps(results()))
    ingest("tau2-bench", [path], tmp_path / "o")
    r = pl.read_parquet(tmp_path / "o" / "rollouts.parquet")
    assert r["task_context"].to_list() == [POLICY] * r.height
    s = pl.read_parquet(tmp_path / "o" / "steps.parquet")
    _check_prompts(r, s, "Never change a plan")


@pytest.mark.parametrize("fmt", ["tau-bench", "tau2-bench"])
def test_real_logs_carry_the_policy(fmt, tmp_path):
    log = TAU if fmt == "tau-bench" else TAU2
    raw = json.loads(log.read_text())
    policy = raw[0]["traj"][0]["content"] if fmt == "tau-bench" \
        else raw["info"]["environment_info"]["policy"]
    ingest(fmt, [log], tmp_path / "o", tokenizer="approx")
    r = pl.read_parquet(tmp_path / "o" / "rollouts.parquet")
    assert r["task_context"].n_unique() == 1 and r["task_context"][0] == policy
    assert "cancel" in policy.lower()
    s = pl.read_parquet(tmp_path / "o" / "steps.parquet")
    _check_prompts(r, s, policy.strip().splitlines()[0])


def test_no_context_leaves_prompts_as_they_were(tmp_path):
    # rollouts without the column (tables written before it) render exactly as before
    r = pl.DataFrame({"rollout_id": ["a"], "group_id": ["g"], "task_id": ["t"],
                      "instruction": ["do it"]})
    s = pl.DataFrame({"rollout_id": ["a"], "step": [1], "action": ["x"], "observation": [""]})
    reqs = stage_requests(r, s, ("generate",), 8, RenderOptions(), Sampling())
    assert _user_texts([reqs[0][3]])[0].startswith("Task:\n")


def test_policy_is_redacted(tmp_path):
    r = pl.DataFrame({"rollout_id": ["a"], "group_id": ["g"], "task_id": ["t"],
                      "instruction": ["do it"],
                      "task_context": ["Policy. Admin key: sk-live-abcdefghijklmnopqrstuvwx"]})
    s = pl.DataFrame({"rollout_id": ["a"], "step": [1], "action": ["x"], "observation": [""]})
    reqs = stage_requests(r, s, ("generate",), 8, RenderOptions(redactor=Redactor()),
                          Sampling())
    text = _user_texts([reqs[0][3]])[0]
    assert "Policy. Admin key" in text and "abcdefghijklmnop" not in text
