"""draco eval against tau-bench's own formula on the real sample, and hand-computed cases."""

from __future__ import annotations

import json
from math import comb

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.evaluate.core import compare, evaluate
from tests.conftest import TAU, examples, run_draco, sample_step


@pytest.fixture(scope="module")
def tau_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tau")
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(d)).returncode == 0
    return d


def display_metrics(results: list[dict]) -> dict[int, float]:
    """A faithful re-implementation of tau-bench's `display_metrics` (sierra-research/tau-bench,
    tau_bench/run.py at 01ed5e3; success bounds from tau_bench/types.py): num_trials is the
    number of distinct `trial` values over ALL results, c counts each task's successes
    (1 − 1e-6 <= reward <= 1 + 1e-6), and pass^k for k = 1..num_trials is the mean over the
    tasks present of C(c, k) / C(num_trials, k) — so a missing trial is a failure."""
    num_trials = len(set(r["trial"] for r in results))
    c_per_task_id: dict = {}
    for r in results:
        ok = 1 if 1.0 - 1e-6 <= r["reward"] <= 1.0 + 1e-6 else 0
        c_per_task_id[r["task_id"]] = c_per_task_id.get(r["task_id"], 0) + ok
    return {k: sum(comb(c, k) / comb(num_trials, k) for c in c_per_task_id.values())
            / len(c_per_task_id) for k in range(1, num_trials + 1)}


def display_metrics_pass_hat(results: list[dict], k: int) -> float:
    return display_metrics(results)[k]


def test_matches_tau_bench_display_metrics(tau_dir):
    raw = json.loads(TAU.read_text())
    res = run_draco("eval", "--rollouts", str(tau_dir / "rollouts.parquet"), "--k", "1,2,3,4",
                    "--json", "-o", str(tau_dir / "eval"))
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    for k in (1, 2, 3, 4):
        assert out["pass_hat_k"][str(k)] == pytest.approx(display_metrics_pass_hat(raw, k),
                                                          abs=1e-12)
    assert out["tgc"] == 0.5 and out["n_tasks"] == 15 and out["n_rollouts"] == 60
    assert out["retention"] == {"k": 4, "tgc": pytest.approx(0.4), "sgc": None, "tasks": 15}
    assert out["pass_at_k"]["4"] == pytest.approx(12 / 15)  # 12 tasks solved at least once
    assert out["termination_shares"]["max_turns"] == pytest.approx(1 / 60)
    assert set(out) >= {"tgc", "sgc", "pass_hat_k", "pass_at_k", "retention", "mean_turns",
                        "termination_shares", "n_tasks", "n_rollouts"}
    m = pl.read_parquet(tau_dir / "eval" / "metrics.parquet")
    assert m.filter((pl.col("metric") == "pass_hat_k") & (pl.col("k") == 2))["value"][0] == \
        pytest.approx(out["pass_hat_k"]["2"])


def frame(rows):
    return pl.DataFrame(rows, schema={"rollout_id": pl.String, "task_id": pl.String,
                                      "scenario_id": pl.String, "trial": pl.Int32,
                                      "outcome": pl.Float64, "termination": pl.String,
                                      "n_turns": pl.Int32, "difficulty": pl.String},
                        orient="row")


def test_sgc_by_hand():
    rows = []
    # scenario s1: tasks a, b, c over trials 0, 1, 2; trial 1 fails on b
    for trial in range(3):
        for t in "abc":
            ok = not (trial == 1 and t == "b")
            rows.append((f"{t}{trial}", t, "s1", trial, 1.0 if ok else 0.0, "submitted", 4,
                         "easy"))
    # scenario s2: tasks d, e; trial 0 complete and successful, trial 1 lacks e
    rows += [("d0", "d", "s2", 0, 1.0, "submitted", 2, "hard"),
             ("e0", "e", "s2", 0, 1.0, "submitted", 2, "hard"),
             ("d1", "d", "s2", 1, 1.0, "max_turns", 9, "hard")]
    res = evaluate(frame(rows), ks=[1, 2], missing="drop")
    s = res.summary
    # s1: 2 of 3 scenario trials succeed; s2: 1 of 1 complete trials
    assert s["sgc"] == pytest.approx((2 / 3 + 1) / 2)
    assert s["sgc_hat_k"][2] == pytest.approx(comb(2, 2) / comb(3, 2))  # s2 has 1 trial: out
    assert any("miss a task" in w for w in res.warnings)
    # task d has 2 trials, e only 1: e is left out of k=2
    assert any("fewer than 2 trials" in w for w in res.warnings)
    assert s["tgc"] == pytest.approx((1 + 2 / 3 + 1 + 1 + 1) / 5)
    # the default counts a missing trial as a failure: 3 trials in the data for every task and
    # scenario, so e misses one (1 of 3) and s2's trials 1 (incomplete) and 2 (absent) fail
    f = evaluate(frame(rows), ks=[1, 2]).summary
    assert f["tgc"] == pytest.approx((1 + 2 / 3 + 1 + 2 / 3 + 1 / 3) / 5)
    assert f["sgc"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert f["sgc_hat_k"][2] == pytest.approx((1 / 3 + 0) / 2)
    assert f["missing"] == {"mode": "fail", "expected_trials": 3, "missing_trials": 3}
    by = evaluate(frame(rows), ks=[1], by=["difficulty"], missing="drop").metrics
    hard = by.filter((pl.col("scope") == "difficulty=hard") & (pl.col("metric") == "tgc"))
    assert hard["value"][0] == 1.0


def test_null_outcomes_and_retention():
    rows = [("x0", "x", None, 0, 1.0, "submitted", 3, None),
            ("x1", "x", None, 1, 0.0, "submitted", 3, None),
            ("x2", "x", None, 2, 1.0, "submitted", 3, None),
            ("x3", "x", None, 3, None, "env_error", 1, None)]
    res = evaluate(frame(rows), ks=[1, 3], missing="drop")
    assert any("null outcome" in w for w in res.warnings)
    assert res.summary["tgc"] == pytest.approx(2 / 3)
    # default: the null-outcome trial is a missing trial, a failure of 4
    assert evaluate(frame(rows), ks=[1, 3]).summary["tgc"] == 0.5
    assert res.summary["pass_hat_k"][3] == 0.0
    assert res.summary["retention"]["tgc"] == 0.0
    assert res.summary["termination_shares"]["env_error"] == 0.25
    assert res.summary["mean_turns"] == 2.5


def test_compare_paired_bootstrap(tau_dir):
    a = pl.read_parquet(tau_dir / "rollouts.parquet")
    better = a.with_columns(pl.lit(1.0).alias("outcome"))
    table = compare(a, better, [1, 2])
    row = table.filter(pl.col("k") == 1).row(0, named=True)
    assert row["a"] == 0.5 and row["b"] == 1.0 and row["difference"] == 0.5
    assert row["ci_low"] <= 0.5 <= row["ci_high"] and row["ci_low"] > 0.2
    assert row["tasks"] == 15
    res = run_draco("eval", "--compare", str(tau_dir), "--compare", str(tau_dir), "--json")
    assert res.returncode == 0, res.stderr.decode()
    same = json.loads(res.stdout)
    assert all(r["difference"] == 0 and r["ci_low"] == 0 == r["ci_high"] for r in same)


def test_several_run_dirs_follow_training(tmp_path):
    for n in (0, 1):
        assert run_draco("run", *sample_step(n, tmp_path / "in"), "--model",
                         "replay/sample_data/llm_calls.sqlite", "--train-step", str(n),
                         "-o", str(tmp_path)).returncode == 0
    res = run_draco("eval", "--rollouts", str(tmp_path / "step-0"), "--rollouts",
                    str(tmp_path / "step-1"), "--k", "1,2", "-o", str(tmp_path / "e"))
    assert res.returncode == 0, res.stderr.decode()
    m = pl.read_parquet(tmp_path / "e" / "metrics.parquet")
    scopes = set(m["scope"])
    assert {"train_step=0", "train_step=1"} <= scopes
    tgc = m.filter((pl.col("metric") == "tgc") & (pl.col("scope") == "train_step=1"))["value"][0]
    assert tgc == pytest.approx((2 / 4 + 1 / 4 + 2 / 4) / 3)  # the sample: 2, 1, 2 of 4 succeed


def _drop_some(raw: list[dict], seed: int, n_drop: int) -> list[dict]:
    import random

    keep = sorted(random.Random(seed).sample(range(len(raw)), len(raw) - n_drop))
    return [raw[i] for i in keep]


@pytest.mark.parametrize("seed,n_drop", [(0, 9), (1, 4), (2, 15)])
def test_unbalanced_trials_match_display_metrics(tmp_path, seed, n_drop):
    """Real tau-bench rollouts with some dropped: draco eval equals tau-bench's own
    display_metrics (missing = failure) by default, and each task's own n with --missing drop."""
    raw = _drop_some(json.loads(TAU.read_text()), seed, n_drop)
    src = tmp_path / "unbalanced.json"
    src.write_text(json.dumps(raw))
    d = tmp_path / "in"
    assert run_draco("ingest", "tau-bench", str(src), "--tokenizer", "approx",
                     "-o", str(d)).returncode == 0
    ref = display_metrics(raw)
    res = run_draco("eval", "--rollouts", str(d), "--k", "1,2,3,4", "--json")
    assert res.returncode == 0, res.stderr.decode()
    out = json.loads(res.stdout)
    for k in (1, 2, 3, 4):
        assert out["pass_hat_k"][str(k)] == pytest.approx(ref[k], abs=1e-15)
    assert out["retention"]["tgc"] == pytest.approx(ref[4] / ref[1], abs=1e-15)
    assert out["missing"]["missing_trials"] == n_drop
    assert "counted as a failure" in res.stderr.decode()
    drop = json.loads(run_draco("eval", "--rollouts", str(d), "--k", "1,2,3,4", "--json",
                                "--missing", "drop").stdout)
    own: dict = {}
    for r in raw:
        n, c = own.get(r["task_id"], (0, 0))
        own[r["task_id"]] = (n + 1, c + (abs(r["reward"] - 1) <= 1e-6))
    for k in (1, 4):
        vals = [comb(c, k) / comb(n, k) for n, c in own.values() if n >= k]
        assert drop["pass_hat_k"][str(k)] == pytest.approx(sum(vals) / len(vals), abs=1e-15)
    # retention over one set of tasks: p^4 / p^1 of the tasks that have 4 trials
    full = [(n, c) for n, c in own.values() if n >= 4]
    assert drop["retention"]["tgc"] == pytest.approx(
        sum(comb(c, 4) for _, c in full) / sum(c / n * comb(n, 4) for n, c in full), abs=1e-12)
    assert drop["retention"]["tasks"] == len(full)


@settings(max_examples=examples(150), deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.integers(0, 10**6), st.floats(0, 0.6))
def test_display_metrics_property(n_tasks, n_trials, seed, p_drop):
    import random

    rng = random.Random(seed)
    raw = [{"task_id": t, "trial": j, "reward": float(rng.random() < 0.6)}
           for t in range(n_tasks) for j in range(n_trials)]
    raw = [r for r in raw if rng.random() >= p_drop] or raw[:1]
    ref = display_metrics(raw)
    df = pl.DataFrame([{"rollout_id": f"{r['task_id']}-{r['trial']}", "task_id": str(r["task_id"]),
                        "scenario_id": None, "trial": r["trial"], "outcome": r["reward"],
                        "termination": "submitted", "n_turns": 1, "difficulty": None}
                       for r in raw], schema=frame([]).schema)
    got = evaluate(df, ks=list(ref)).summary
    for k, v in ref.items():
        assert got["pass_hat_k"][k] == pytest.approx(v, abs=1e-15)
def test_several_run_dirs_show_per_step_figures_and_warn_on_repeated_ids(tmp_path):
    for n in (0, 1):
        assert run_draco("run", *sample_step(n, tmp_path / "in"), "--model",
                         "replay/sample_data/llm_calls.sqlite", "--train-step", str(n),
                         "-o", str(tmp_path)).returncode == 0
    args = ["eval", "--rollouts", str(tmp_path / "step-0"), "--rollouts",
            str(tmp_path / "step-1"), "--k", "1,2", "--by", "difficulty"]
    res = run_draco(*args, "--json")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    one = doc["by"]["train_step=1"]
    assert one["tgc"] == pytest.approx((2 / 4 + 1 / 4 + 2 / 4) / 3) and one["n_rollouts"] == 12
    assert set(one["pass_hat_k"]) == {"1", "2"}
    assert any(scope.startswith("difficulty=") for scope in doc["by"])
    assert "12 rollout id(s) appear in several train steps" in res.stderr.decode()
    assert doc["warnings"] and doc["n_rollouts"] == 24
    screen = run_draco(*args).stdout.decode()
    assert "train_step=0" in screen and "train_step=1" in screen and "difficulty=" in screen
    same = run_draco("eval", "--rollouts", str(tmp_path / "step-0"), "--rollouts",
                     str(tmp_path / "step-0"))
    assert same.returncode == 2 and b"same rollouts twice" in same.stderr


def test_eval_bad_k_and_compare_without_shared_tasks(tau_dir, tmp_path):
    for bad in ("abc", "0,1", ","):
        res = run_draco("eval", "--rollouts", str(tau_dir), "--k", bad)
        assert res.returncode == 2 and b"--k" in res.stderr and b"Traceback" not in res.stderr
    other = pl.read_parquet(tau_dir / "rollouts.parquet").with_columns(
        pl.col("task_id") + "-elsewhere")
    other.write_parquet(tmp_path / "other.parquet")
    res = run_draco("eval", "--compare", str(tau_dir), "--compare",
                    str(tmp_path / "other.parquet"), "--json")
    assert res.returncode == 1 and b"share no task_id" in res.stderr and res.stdout == b""


def test_a_breakdown_by_a_column_without_values_says_so(tau_dir):
    rollouts = pl.read_parquet(tau_dir / "rollouts.parquet")
    assert rollouts["difficulty"].null_count() == rollouts.height   # tau-bench has none
    res = evaluate(rollouts, by=["difficulty"])
    assert not res.metrics.filter(pl.col("scope").str.starts_with("difficulty=")).height
    assert "--by difficulty: every rollout's difficulty is null: no breakdown by it" in res.warnings
    some = rollouts.with_columns(pl.when(pl.int_range(pl.len()) < 4).then(pl.lit("easy"))
                                 .alias("difficulty"))
    assert f"--by difficulty: {rollouts.height - 4} rollout(s) with null difficulty are in no " \
        "breakdown" in evaluate(some, by=["difficulty"]).warnings
    p = run_draco("eval", "--rollouts", str(tau_dir), "--by", "difficulty")
    assert p.returncode == 0 and "no breakdown by it" in p.stderr.decode()
