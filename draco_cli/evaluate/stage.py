"""Evaluation operation (``draco eval``): read rollouts tables or run folders, compute TGC, SGC,
pass^k, pass@k, retention and terminations (``draco_cli.evaluate.core``), and publish the metrics
table as a locked output set checked against its contract; or compare two runs task by task."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import polars as pl

from draco_cli.errors import InputError, UsageError
from draco_cli.evaluate.core import EvalResult, compare, evaluate
from draco_cli.io import check_writable, read_table
from draco_cli.publish import publish_tables
from draco_cli.run.folder import RunFolder
from draco_cli.schemas import Metric, Rollout

EVAL_COLUMNS = ["rollout_id", "group_id", "task_id", "train_step", "trial", "scenario_id",
                "difficulty", "outcome", "termination", "n_turns"]


def read_rollouts(path: Path) -> pl.DataFrame:
    """A rollouts table, a folder holding rollouts.parquet, or a draco run folder (its
    manifest names the rollouts it ran on, and its train step)."""
    path = Path(path)
    step = None
    if path.is_dir():
        if (path / "rollouts.parquet").exists() or not RunFolder.is_run_folder(path):
            path = path / "rollouts.parquet"
        else:
            folder = RunFolder.open(path)
            step = folder.train_step
            path = folder.rollouts
    r = read_table(path, Rollout, columns=EVAL_COLUMNS)
    if step is not None:
        # the run folder's training step labels its rollouts (a run made with --train-step N)
        r = r.with_columns(pl.lit(step, dtype=pl.Int32).alias("train_step"))
    return r


def evaluate_runs(rollouts: list[Path], ks: list[int], *, by: list[str] | None = None,
                  missing: str = "fail", out: Path | None = None, force: bool = False
                  ) -> EvalResult:
    """The figures of one or several rollouts tables (one per training step: figures per
    train_step too), published to ``out/metrics.parquet`` when ``out`` is given."""
    if not rollouts:
        raise UsageError("--rollouts: give --rollouts (or --compare A --compare B)")
    if out is not None:
        check_writable(Path(out) / "metrics.parquet", force)
    frames = [read_rollouts(p) for p in rollouts]
    by = list(by or [])
    if len(frames) > 1:
        keyed = [set(zip(f["rollout_id"], f["train_step"])) for f in frames]
        if len(set().union(*keyed)) < sum(len(x) for x in keyed):
            raise UsageError(
                "--rollouts: the inputs share rollout ids within one train step (the same "
                "rollouts twice?): pass run folders made with --train-step, or each rollouts "
                "table once")
        if "train_step" not in by:
            by.append("train_step")
    pooled = pl.concat(frames, how="vertical_relaxed")
    result = evaluate(pooled, ks, by, missing)
    if pooled["rollout_id"].is_duplicated().any():
        ids = pooled.filter(pl.col("rollout_id").is_duplicated())["rollout_id"].n_unique()
        result.warnings.append(f"{ids} rollout id(s) appear in several train steps; the overall "
                               "figures pool all steps, the train_step columns keep them apart")
    if out is not None:
        t = publish_tables(out, {"metrics": (result.metrics, Metric)}, force=force)
        result = replace(result, metrics=t["metrics"])
    return result


def compare_runs(a: Path, b: Path, ks: list[int], *, missing: str = "fail") -> pl.DataFrame:
    """Run B against run A task by task: both figures, B − A and a paired bootstrap 95% CI."""
    ra, rb = read_rollouts(a), read_rollouts(b)
    shared = set(ra["task_id"].drop_nulls()) & set(rb["task_id"].drop_nulls())
    if not shared:
        raise InputError(f"{a} and {b} share no task_id: nothing to compare (B − A is taken "
                         "task by task)")
    res = compare(ra, rb, ks, missing=missing)
    if res.height == 0:
        raise InputError(f"the {len(shared)} shared task(s) have fewer than k={min(ks)} "
                         "scored trials in one of the runs: lower --k")
    return res
