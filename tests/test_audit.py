"""Audits on hand-computed cases; p-values against scipy on the same counts."""

from __future__ import annotations

import json
import os

import numpy as np
import polars as pl
import pytest
from scipy import optimize, stats

from draco_cli.audit import cost_audit, overlap_audit, rubric_audit, self_judge_audit
from draco_cli.io import write_table
from draco_cli.schemas import Rollout, VerdictAggregated
from tests.conftest import run_draco, sample_step

# (rollout, criterion, reference verdict, self verdict); rollouts a, b at step 1; c, d at step 2
PAIRS = [("a", "c1", "pass", "pass"), ("a", "c2", "pass", "fail"), ("a", "c3", "fail", "pass"),
         ("b", "c1", "fail", "fail"), ("b", "c2", "na", "na"), ("b", "c3", "pass", None),
         ("c", "c1", "pass", "pass"), ("c", "c2", "fail", "pass"),
         ("d", "c1", "fail", "pass"), ("d", "c2", "pass", "pass"), ("d", "c3", None, "pass")]
STEP = {"a": 1, "b": 1, "c": 2, "d": 2}


def verdicts(which: int, judge: str) -> pl.DataFrame:
    return pl.DataFrame([{"rollout_id": p[0], "criterion_id": p[1], "judge": judge,
                          "verdict": p[which], "cited_steps": [], "reason": None}
                         for p in PAIRS], schema_overrides={"cited_steps": pl.List(pl.Int32)})


ROLLOUTS = pl.DataFrame({"rollout_id": list(STEP), "group_id": [f"t/{s}" for s in STEP.values()],
                         "task_id": ["t"] * 4, "train_step": list(STEP.values()),
                         "instruction": ["i"] * 4, "n_turns": [1] * 4},
                        schema_overrides={"train_step": pl.Int32, "n_turns": pl.Int32})


def test_self_judge_figures_by_hand():
    agreement, tests = self_judge_audit(verdicts(3, "self"), verdicts(2, "gpt"), ROLLOUTS)
    o = agreement.filter(pl.col("scope") == "overall").row(0, named=True)
    assert o["n_rows"] == 10                       # the null reference verdict is left out
    assert o["agreement"] == 0.5                   # 5 of 10 equal (self unanswered disagrees)
    assert o["pass_all_baseline"] == 0.5           # reference says pass on 5 of 10
    assert o["false_pass_rate"] == 0.75            # self pass on 3 of 4 reference fails
    assert o["false_fail_rate"] == 0.2             # self fail on 1 of 5 reference passes
    assert o["leniency_ratio"] == pytest.approx(3.75)
    assert o["unanswered_rate"] == 0.1
    assert o["criteria_per_rollout"] == 2.5
    assert o["reference_fail_share"] == 0.4
    scopes = agreement["scope"].to_list()
    assert scopes == ["overall", "step:1", "step:2", "first_quarter", "last_quarter"]
    s1 = agreement.filter(pl.col("scope") == "step:1").row(0, named=True)
    assert s1["agreement"] == 0.5 and s1["false_fail_rate"] == pytest.approx(1 / 3)

    # two train steps: too few for a step-level test (each step one observation)
    assert set(tests["test"]) == {"welch_t_first_vs_last_quarter", "wls_trend_per_step"}
    assert tests["p_value"].is_null().all()
    assert set(tests.filter(pl.col("test") == "wls_trend_per_step")["n_steps"]) == {2}


def test_logistic_trend_against_a_direct_mle():
    from tests.pooled_trend import logistic_trend

    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, size=400).astype(float)
    y = (rng.random(400) < 1 / (1 + np.exp(-(-1 + 0.04 * x)))).astype(float)
    slope, z, p = logistic_trend(y, x)

    def nll(b):
        eta = b[0] + b[1] * x
        return np.sum(np.logaddexp(0, eta) - y * eta)

    fit = optimize.minimize(nll, np.zeros(2), method="BFGS", options={"gtol": 1e-10})
    assert slope == pytest.approx(fit.x[1], rel=1e-5)
    mu = 1 / (1 + np.exp(-(fit.x[0] + fit.x[1] * x)))
    X = np.column_stack([np.ones_like(x), x])
    se = np.sqrt(np.linalg.inv(X.T @ (X * (mu * (1 - mu))[:, None]))[1, 1])
    assert p == pytest.approx(2 * stats.norm.sf(abs(fit.x[1] / se)), rel=1e-4)
    assert logistic_trend(np.ones(10), np.arange(10.0)) == (None, None, None)


def test_leniency_is_null_without_false_fails():
    v_ref = pl.DataFrame({"rollout_id": ["a", "a"], "criterion_id": ["x", "y"],
                          "verdict": ["pass", "fail"]})
    v_self = v_ref.with_columns(pl.Series("verdict", ["pass", "pass"]))
    agreement, tests = self_judge_audit(v_self, v_ref, None)
    o = agreement.row(0, named=True)
    assert o["false_fail_rate"] == 0 and o["leniency_ratio"] is None
    assert tests.height == 0  # no train steps, no tests


def test_overlap_is_one_to_one():
    own = pl.DataFrame({"group_id": ["g", "g"], "title": ["Deduplicates artists before follow",
                                                          "Avoids duplicate artist follows"],
                        "requirement": ["Each artist followed once.", "Each artist followed once."]})
    ref = pl.DataFrame({"group_id": ["g"], "title": ["Deduplicates artists before following"],
                        "requirement": ["Each artist is followed once."]})
    per_unit, summary = overlap_audit(own, ref, "group", threshold=0.3)
    o = summary.row(0, named=True)
    assert o["matched"] == 1 and o["recall"] == 1.0 and o["precision"] == 0.5


def test_overlap_ceiling_at_group_level():
    rollouts = pl.DataFrame({"rollout_id": ["r1", "r2"], "group_id": ["t/1", "t/2"],
                             "task_id": ["t", "t"], "train_step": [1, 2]})
    ref = pl.DataFrame({"group_id": ["t/1", "t/1", "t/2"],
                        "title": ["Reads every page", "Stops when done", "Reads every page"],
                        "requirement": ["All pages read.", "No extra actions.", "All pages read."]})
    _, summary = overlap_audit(ref, ref, "group", rollouts)
    rows = {r["scope"]: r for r in summary.iter_rows(named=True)}
    assert rows["overall"]["recall"] == 1.0
    assert rows["ceiling"]["units"] == 1 and rows["ceiling"]["matched"] == 1
    assert set(rows) >= {"overall", "step:1", "step:2", "ceiling"}


def test_rubric_statistics_by_hand():
    rubrics = pl.DataFrame({"group_id": ["t1/0", "t1/0", "t2/0"],
                            "criterion_id": ["x", "y", "z"],
                            "title": ["Reads pages", "Stops", "Stops"],
                            "requirement": ["All pages.", "Ends.", "Ends."],
                            "source": ["merge"] * 3})
    v = pl.DataFrame({"rollout_id": ["a", "b", "a", "b", "c", "d"],
                      "criterion_id": ["x", "x", "y", "y", "z", "z"], "judge": ["j"] * 6,
                      "verdict": ["fail", "pass", "na", "pass", "pass", "pass"],
                      "cited_steps": [[]] * 6}, schema_overrides={"cited_steps": pl.List(pl.Int32)})
    rollouts = pl.DataFrame({"rollout_id": list("abcd"), "group_id": ["t1/0", "t1/0", "t2/0", "t2/0"],
                             "task_id": ["t1", "t1", "t2", "t2"]})
    summary, per = rubric_audit(rubrics, v, rollouts)
    s = summary.row(0, named=True)
    assert s["criteria"] == 3 and s["criteria_per_group"] == 1.5
    assert s["discriminative_share"] == pytest.approx(1 / 3)    # only x was failed
    assert s["distinct_criteria"] == 2                          # "Stops" written for two tasks
    assert s["single_task_share"] == 0.5                        # "Reads pages" only for t1
    assert s["single_task_judgment_share"] == pytest.approx(2 / 6)
    assert s["verdict_failure_share"] == pytest.approx(1 / 5)   # 1 fail of 5 pass+fail
    assert per["criterion_id"][0] == "y" and per["na_rate"][0] == 0.5  # worst na first


def test_cost_per_phase_step_and_projection(tmp_path):
    from draco_cli.llm.calllog import CallLog

    with CallLog(tmp_path / "c.sqlite") as log:
        for key, phase, cost in [("r1", "score", 0.5), ("r2", "score", 0.25), ("g1", "merge", 1.0),
                                 ("r1", "score", 0.0)]:
            log.record(phase=phase, key=key, status="ok" if cost else "http_error",
                       input_tokens=100, output_tokens=10, cost_usd=cost)
    from draco_cli.audit import AUDIT_COST_COLUMNS, read_cost_rows

    rollouts = pl.DataFrame({"rollout_id": ["r1", "r2"], "group_id": ["g1", "g2"],
                             "train_step": [1, 2]})
    per_phase, per_step, projected = cost_audit(
        read_cost_rows(tmp_path / "c.sqlite", AUDIT_COST_COLUMNS), rollouts)
    ph = {r["phase"]: r for r in per_phase.iter_rows(named=True)}
    assert ph["score"]["calls"] == 3 and ph["score"]["cost_usd"] == 0.75
    assert ph["merge"]["cost_usd"] == 1.0
    steps = dict(per_step.select("train_step", "cost_usd").iter_rows())
    assert steps == {1: 1.5, 2: 0.25}
    assert projected == pytest.approx(87.5)


def test_cli_self_judge_json(tmp_path):
    write_table(verdicts(3, "self"), tmp_path / "self.parquet", VerdictAggregated)
    write_table(verdicts(2, "gpt"), tmp_path / "ref.parquet", VerdictAggregated)
    write_table(ROLLOUTS, tmp_path / "rollouts.parquet", Rollout)
    res = run_draco("audit", "self-judge", "--self", str(tmp_path / "self.parquet"),
                    "--reference", str(tmp_path / "ref.parquet"), "--rollouts",
                    str(tmp_path / "rollouts.parquet"), "-o", str(tmp_path / "a"), "--json")
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    assert out["overall"]["agreement"] == 0.5 and len(out["tests"]) == 6
    assert pl.read_parquet(tmp_path / "a" / "agreement.parquet").height == 5
    assert b"false_pass_rate" in res.stdout and b"false_pass_rate" not in res.stderr


@pytest.mark.parametrize("matcher", ["embedding", "llm"])
def test_overlap_cli_with_model_matchers(tmp_path, monkeypatch, matcher):
    from tests.llm_server import FakeLLMServer

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-local-000000000000")
    own = pl.DataFrame({"group_id": ["g", "g"], "title": ["Reads every page", "Stops when done"],
                        "requirement": ["All pages read.", "No extra actions."]})
    ref = pl.DataFrame({"group_id": ["g"], "title": ["Reads every page"],
                        "requirement": ["All pages read."]})
    own.write_parquet(tmp_path / "own.parquet")
    ref.write_parquet(tmp_path / "ref.parquet")
    # the llm matcher's model pairs own 0 with reference 0, and (wrongly) own 1 with it too
    s = FakeLLMServer(answer=lambda body, i: json.dumps(
        {"pairs": [{"own": 0, "reference": 0}, {"own": 1, "reference": 0}]})).start()
    try:
        res = run_draco("audit", "overlap", "--own", str(tmp_path / "own.parquet"),
                        "--reference", str(tmp_path / "ref.parquet"), "--matcher", matcher,
                        "--model", "openai/m", "--base-url", s.url + "/v1",
                        "-o", str(tmp_path / "o"))
    finally:
        s.stop()
    assert res.returncode == 0, res.stderr.decode()
    o = pl.read_parquet(tmp_path / "o" / "overlap.parquet").row(0, named=True)
    assert o["matched"] == 1 and o["recall"] == 1.0 and o["precision"] == 0.5  # one-to-one
    assert s.hits["embeddings" if matcher == "embedding" else "chat"] >= 1


def test_cost_over_several_run_folders(tmp_path):
    for n in (0, 1):
        assert run_draco("run", *sample_step(n, tmp_path / "in"), "--model",
                         "replay/sample_data/llm_calls.sqlite", "--train-step", str(n),
                         "-o", str(tmp_path)).returncode == 0
    res = run_draco("audit", "cost", "--calls", str(tmp_path / "step-0"), "--calls",
                    str(tmp_path / "step-1"), "-o", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr.decode()
    per_step = pl.read_parquet(tmp_path / "a" / "cost_step.parquet")
    assert per_step["train_step"].to_list() == [0, 1]
    assert per_step["calls"].to_list() == [30, 30]  # 12 generate + 3 union + 3 merge + 12 score
    phase = pl.read_parquet(tmp_path / "a" / "cost_phase.parquet")
    assert dict(phase.select("phase", "calls").iter_rows()) == {
        "generate": 24, "merge": 6, "score": 24, "union": 6}


def test_self_judge_over_run_folders(tmp_path, monkeypatch):
    from tests.llm_server import FakeLLMServer
    from tests.test_rubric_judge import scripted

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-audit-00000000000")
    s = FakeLLMServer(answer=scripted).start()
    try:
        for n in (0, 1, 2, 3):
            for label, model in (("self", "openai/self-model"), ("ref", "openai/ref-model")):
                res = run_draco("run", *sample_step(n, tmp_path / "in"), "--model",
                                model, "--base-url", s.url + "/v1", "--setting", "static",
                                "--train-step", str(n), "--judge-label", label,
                                "-o", str(tmp_path / label))
                assert res.returncode == 0, res.stderr.decode()
    finally:
        s.stop()
    args = []
    for n in range(4):
        args += ["--self", str(tmp_path / "self" / f"step-{n}"),
                 "--reference", str(tmp_path / "ref" / f"step-{n}")]
    res = run_draco("audit", "self-judge", *args, "-o", str(tmp_path / "a"), "--json")
    assert res.returncode == 0, res.stderr.decode()
    a = pl.read_parquet(tmp_path / "a" / "agreement.parquet")
    assert {"step:0", "step:3", "first_quarter", "last_quarter"} <= set(a["scope"])
    # the scripted judge answers the same prompt the same way: the two arms agree fully
    assert a.filter(pl.col("scope") == "overall")["agreement"][0] == 1.0


def test_one_train_step_is_one_step_in_both_quarters():
    from draco_cli.audit.stats import step_tests

    tests = step_tests("m", [(0, 0.5, 10)])
    assert [(t["test"], t["n_steps"]) for t in tests] == [("welch_t_first_vs_last_quarter", 1),
                                                          ("wls_trend_per_step", 1)]
    assert all(t["statistic"] is None and t["p_value"] is None for t in tests)
    many = step_tests("m", [(s, 0.1 * s, 10) for s in range(8)])   # quarters [0, 1], [6, 7]
    assert many[0]["n_steps"] == 4 and many[1]["n_steps"] == 8


def test_llm_matcher_labels_a_pair_alike_in_every_process():
    import subprocess
    import sys

    code = ("from draco_cli.audit.matchers import LLMMatcher; "
            "print(LLMMatcher(None).requests(['a', 'b'], ['c']).key)")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert len(keys) == 1 and keys.pop().strip()
