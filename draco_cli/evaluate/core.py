"""Evaluation metrics (SPEC §5): TGC, SGC, pass^k, pass@k, retention, termination modes, turns.

Conventions (tau-bench's) and unbalanced trials (``missing="fail"`` / ``"drop"``): see
docs/evaluation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any

import numpy as np
import polars as pl

from draco_cli.errors import UsageError
from draco_cli.schemas import Metric, polars_schema

SUCCESS_TOL = 1e-6
MISSING_MODES = ("fail", "drop")


@dataclass
class EvalResult:
    metrics: pl.DataFrame  # long form: scope, metric, k, value, n
    summary: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def expected_trials(rollouts: pl.DataFrame) -> int:
    """The trials every task should have: the distinct `trial` values in the data (tau-bench's
    `num_trials`), or — when some rollout has no trial index — the most rollouts any task has."""
    if rollouts.height == 0:
        return 0
    if "trial" in rollouts.columns and rollouts["trial"].null_count() == 0:
        return int(rollouts["trial"].n_unique())
    return int(rollouts.group_by("task_id").len()["len"].to_numpy().max())


def task_counts(rollouts: pl.DataFrame, missing: str = "fail") -> pl.DataFrame:
    """Per task: trials n, successes c and scored rollouts. `missing="fail"`: n is the trials
    every task should have (`expected_trials`), so missing and null-outcome trials are failures;
    a task with more rollouts than that (pooled training steps) keeps its own count.
    `missing="drop"`: n is the task's own count of scored rollouts."""
    if missing not in MISSING_MODES:
        raise UsageError(f"--missing takes fail or drop, not {missing!r}")
    ok = (pl.col("outcome") - 1.0).abs() <= SUCCESS_TOL
    per = rollouts.group_by("task_id").agg(
        pl.len().alias("rows"), pl.col("outcome").is_not_null().sum().alias("scored"),
        ok.fill_null(False).sum().alias("c"))
    if missing == "drop":
        return per.filter(pl.col("scored") > 0).select(
            "task_id", pl.col("scored").alias("n"), "c", "scored")
    N = expected_trials(rollouts)
    return per.select("task_id", pl.max_horizontal(pl.lit(N), pl.col("rows")).alias("n"), "c",
                      "scored")


def pass_hat(n: int, c: int, k: int) -> float:
    return comb(c, k) / comb(n, k)


def pass_at(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


def _estimate(counts: list[tuple[int, int]], k: int,
              f: Callable[[int, int, int], float]) -> tuple[float | None, int, int]:
    """(mean over units with n >= k, units used, units excluded for n < k)."""
    vals = [f(n, c, k) for n, c in counts if n >= k]
    excluded = sum(1 for n, _ in counts if n < k)
    return (float(np.mean(vals)) if vals else None), len(vals), excluded


def scenario_counts(rollouts: pl.DataFrame, warnings: list[str], missing: str = "fail"
                    ) -> list[tuple[int, int]]:
    """Per scenario: trials n and successful trials c. A scenario trial succeeds iff every task
    of the scenario has a successful scored rollout in that trial. `missing="fail"`: n is the
    distinct trials of the scenario rollouts, so an incomplete scenario trial is a failure;
    `missing="drop"`: incomplete scenario trials are left out."""
    r = rollouts.filter(pl.col("scenario_id").is_not_null() & pl.col("trial").is_not_null())
    if r.height == 0:
        return []
    ok = ((pl.col("outcome") - 1.0).abs() <= SUCCESS_TOL).fill_null(False)
    tasks = r.group_by("scenario_id").agg(pl.col("task_id").n_unique().alias("tasks"))
    trials = r.filter(pl.col("outcome").is_not_null()).group_by("scenario_id", "trial").agg(
        pl.col("task_id").n_unique().alias("present"), ok.all().alias("ok")).join(
        tasks, on="scenario_id")
    complete = pl.col("present") == pl.col("tasks")
    if missing == "fail":
        N = int(r["trial"].n_unique())
        won = trials.filter(complete & pl.col("ok")).group_by("scenario_id").len()
        per = tasks.join(won, on="scenario_id", how="left").select(
            pl.lit(N).alias("n"), pl.col("len").fill_null(0).alias("c"))
        return [(int(n), int(c)) for n, c in per.iter_rows()]
    incomplete = trials.filter(~complete).height
    if incomplete:
        warnings.append(f"{incomplete} scenario trial(s) miss a task and were left out of SGC")
    full = trials.filter(complete)
    per = full.group_by("scenario_id").agg(pl.len().alias("n"), pl.col("ok").sum().alias("c"))
    return [(int(n), int(c)) for n, c in per.select("n", "c").iter_rows()]


def _retention(counts: list[tuple[int, int]], kmax: int) -> tuple[float | None, int]:
    """p^kmax / p^1 over the same units (those with n >= kmax), and how many there are."""
    same = [(n, c) for n, c in counts if n >= kmax]
    if not same:
        return None, 0
    p1 = float(np.mean([pass_hat(n, c, 1) for n, c in same]))
    pk = float(np.mean([pass_hat(n, c, kmax) for n, c in same]))
    return (pk / p1 if p1 else None), len(same)


def _metrics_for(rollouts: pl.DataFrame, ks: list[int], scope: str, warnings: list[str],
                 missing: str = "fail") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    tc = task_counts(rollouts, missing)
    counts = [(int(n), int(c)) for n, c in tc.select("n", "c").iter_rows()]
    summary: dict[str, Any] = {"pass_hat_k": {}, "pass_at_k": {}, "sgc_hat_k": {}}
    for k in ks:
        v, used, excl = _estimate(counts, k, pass_hat)
        rows.append({"scope": scope, "metric": "pass_hat_k", "k": k, "value": v, "n": used})
        summary["pass_hat_k"][k] = v
        if excl:
            warnings.append(f"{scope}: {excl} task(s) with fewer than {k} trials left out of "
                            f"k={k}")
        v, used, _ = _estimate(counts, k, pass_at)
        rows.append({"scope": scope, "metric": "pass_at_k", "k": k, "value": v, "n": used})
        summary["pass_at_k"][k] = v
    tgc = summary["pass_hat_k"].get(1)
    if 1 not in ks:
        tgc, _, _ = _estimate(counts, 1, pass_hat)
    rows.append({"scope": scope, "metric": "tgc", "k": 1, "value": tgc, "n": len(counts)})
    scen = scenario_counts(rollouts, warnings, missing)
    sgc = None
    if scen:
        for k in ks:
            v, used, _ = _estimate(scen, k, pass_hat)
            rows.append({"scope": scope, "metric": "sgc_hat_k", "k": k, "value": v, "n": used})
            summary["sgc_hat_k"][k] = v
        sgc, _, _ = _estimate(scen, 1, pass_hat)
        rows.append({"scope": scope, "metric": "sgc", "k": 1, "value": sgc, "n": len(scen)})
    kmax = max(ks)
    retention, ret_units = _retention(counts, kmax)
    rows.append({"scope": scope, "metric": "retention", "k": kmax, "value": retention,
                 "n": ret_units})
    sgc_ret = None
    if scen:
        sgc_ret, sgc_units = _retention(scen, kmax)
        if sgc_units:
            rows.append({"scope": scope, "metric": "sgc_retention", "k": kmax, "value": sgc_ret,
                         "n": sgc_units})
    turns = rollouts["n_turns"].mean() if rollouts.height else None
    rows.append({"scope": scope, "metric": "mean_turns", "k": None, "value": turns,
                 "n": rollouts.height})
    shares = {}
    if rollouts.height:
        for mode, cnt in rollouts.group_by("termination").len().sort("termination").iter_rows():
            shares[str(mode) if mode is not None else "unknown"] = cnt / rollouts.height
    for mode, share in sorted(shares.items()):
        rows.append({"scope": scope, "metric": f"termination:{mode}", "k": None, "value": share,
                     "n": rollouts.height})
    full = tc if missing == "fail" else task_counts(rollouts, "fail")
    n_missing = int((full["n"] - full["scored"]).sum()) if full.height else 0
    summary.update(tgc=tgc, sgc=sgc,
                   retention={"k": kmax, "tgc": retention, "sgc": sgc_ret, "tasks": ret_units},
                   mean_turns=turns, termination_shares=shares, n_tasks=len(counts),
                   n_rollouts=rollouts.height,
                   missing={"mode": missing, "expected_trials": expected_trials(rollouts),
                            "missing_trials": n_missing})
    return rows, summary


def missing_note(summary: dict[str, Any]) -> str:
    """One line saying how unbalanced trials were counted (SPEC §5: always printed)."""
    m = summary["missing"]
    how = ("each counted as a failure (tau-bench's display_metrics convention; --missing drop "
           "uses each task's own trials)" if m["mode"] == "fail" else
           "dropped: each task uses its own trials (--missing drop; not comparable with "
           "tau-bench's leaderboard)")
    return (f"trials: {m['expected_trials']} expected per task, {m['missing_trials']} missing "
            f"(absent or null outcome), {how}")


def evaluate(rollouts: pl.DataFrame, ks: Sequence[int] = (1, 2, 3), by: Sequence[str] = (),
             missing: str = "fail") -> EvalResult:
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1:
        raise UsageError("--k takes positive integers, e.g. 1,2,3")
    warnings: list[str] = []
    nulls = rollouts["outcome"].null_count()
    if nulls:
        warnings.append(f"{nulls} rollout(s) with null outcome left out of their task's trials")
    rows, summary = _metrics_for(rollouts, ks, "overall", warnings, missing)
    for col in by:
        if col not in rollouts.columns:
            raise UsageError(f"--by {col!r}: rollouts have no such column")
        if (nulls := rollouts[col].null_count()) == rollouts.height:
            warnings.append(f"--by {col}: every rollout's {col} is null: no breakdown by it")
        elif nulls:
            warnings.append(f"--by {col}: {nulls} rollout(s) with null {col} are in no breakdown")
        for value in sorted(rollouts[col].drop_nulls().unique().to_list()):
            part = rollouts.filter(pl.col(col) == value)
            r, _ = _metrics_for(part, ks, f"{col}={value}", [], missing)
            rows += r
    if "train_step" in rollouts.columns and "train_step" not in by:
        for value in sorted(rollouts["train_step"].drop_nulls().unique().to_list()):
            part = rollouts.filter(pl.col("train_step") == value)
            for mode, cnt in part.group_by("termination").len().sort("termination").iter_rows():
                rows.append({"scope": f"train_step={value}",
                             "metric": f"termination:{mode if mode is not None else 'unknown'}",
                             "k": None, "value": cnt / part.height, "n": part.height})
            rows.append({"scope": f"train_step={value}", "metric": "mean_turns", "k": None,
                         "value": part["n_turns"].mean(), "n": part.height})
    metrics = pl.DataFrame(rows, schema=polars_schema(Metric))
    return EvalResult(metrics, summary, warnings)


def compare(a: pl.DataFrame, b: pl.DataFrame, ks: list[int], n_boot: int = 2000,
            seed: int = 0, missing: str = "fail") -> pl.DataFrame:
    """B − A per pass^k over the tasks both runs have, with a paired bootstrap 95% CI
    (tasks resampled with replacement, the same draw for both runs)."""
    ta, tb = task_counts(a, missing), task_counts(b, missing)
    j = ta.join(tb, on="task_id", suffix="_b")
    rng = np.random.default_rng(seed)
    rows = []
    for k in sorted(set(ks)):
        ok = j.filter((pl.col("n") >= k) & (pl.col("n_b") >= k))
        if ok.height == 0:
            continue
        pa = np.array([pass_hat(n, c, k) for n, c in ok.select("n", "c").iter_rows()])
        pb = np.array([pass_hat(n, c, k) for n, c in ok.select("n_b", "c_b").iter_rows()])
        d = pb - pa
        idx = rng.integers(0, d.size, size=(n_boot, d.size))
        boots = d[idx].mean(axis=1)
        lo, hi = np.percentile(boots, [2.5, 97.5])
        rows.append({"metric": "pass_hat_k", "k": k, "a": float(pa.mean()), "b": float(pb.mean()),
                     "difference": float(d.mean()), "ci_low": float(lo), "ci_high": float(hi),
                     "tasks": int(d.size)})
    return pl.DataFrame(rows, schema={"metric": pl.String, "k": pl.Int64, "a": pl.Float64,
                                      "b": pl.Float64, "difference": pl.Float64,
                                      "ci_low": pl.Float64, "ci_high": pl.Float64,
                                      "tasks": pl.Int64})
