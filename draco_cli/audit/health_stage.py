"""``draco audit judge-health``: read several train steps' run folders and publish the judge
health tables (``draco_cli.audit.judge_health``)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from draco_cli.audit.judge_health import ALPHA, MIN_STEPS, JudgeHealth, judge_health
from draco_cli.errors import InputError, UsageError
from draco_cli.io import read_table
from draco_cli.run.folder import RunFolder

HEALTH_NAMES = ["judge_health_steps", "judge_health_criteria", "judge_health_trends"]


def step_folders(paths: list[Path]) -> list[tuple[int, RunFolder]]:
    """Run folders (a RUN_ROOT stands for its step-N folders), each with its train step, in
    step order; a folder without a train step or a step given twice is a usage error."""
    from draco_cli.sql import expand_run_roots

    out: dict[int, RunFolder] = {}
    for p in expand_run_roots([Path(x) for x in paths]):
        if not RunFolder.is_run_folder(p):
            raise UsageError(f"{p}: not a draco run folder (no manifest.json); give run "
                             "folders or the folder `draco run --train-step N -o ROOT` wrote")
        folder = RunFolder.open(p)
        step = folder.train_step
        if step is None:
            raise UsageError(f"{p}: the run has no train step; make each step's run with "
                             "`draco run --train-step N`")
        if step in out:
            raise UsageError(f"{p}: train step {step} given twice (also {out[step].path})")
        out[step] = folder
    if not out:
        raise UsageError("give at least one run folder")
    return sorted(out.items())


def read_health_inputs(paths: list[Path], judge: str | None = None
                       ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame | None,
                                  pl.DataFrame | None, pl.DataFrame | None]:
    """(verdicts, rollouts, rewards or None, rubrics or None, spot checks or None) of every
    step, each with ``train_step``."""
    from draco_cli.audit.stage import read_verdicts
    from draco_cli.schemas import Reward, Rollout, Rubric, SpotCheck

    vs, rs, ws, bs, ss = [], [], [], [], []
    for step, f in step_folders(paths):
        tag = pl.lit(step, pl.Int64).alias("train_step")
        if not f.has("verdicts"):
            raise InputError("the run has no verdicts (its judge stage did not finish)",
                             file=str(f.table("verdicts")))
        vs.append(read_verdicts(f.table("verdicts"), judge).select(
            "rollout_id", "criterion_id", "verdict").with_columns(tag))
        rs.append(read_table(f.rollouts, Rollout, columns=["rollout_id", "group_id", "outcome"])
                  .with_columns(pl.col("outcome").cast(pl.Float64), tag))
        if f.has("rewards"):
            ws.append(read_table(f.table("rewards"), Reward).select(
                "rollout_id", pl.col("reward").cast(pl.Float64)).with_columns(tag))
        if f.has("rubrics"):
            bs.append(read_table(f.table("rubrics"), Rubric).select(
                "group_id", "criterion_id", "title").with_columns(tag))
        if f.has("spot_checks"):   # the run folder's step, whatever the table says
            ss.append(read_table(f.table("spot_checks"), SpotCheck).with_columns(tag))
    return (pl.concat(vs), pl.concat(rs), pl.concat(ws) if ws else None,
            pl.concat(bs) if bs else None, pl.concat(ss) if ss else None)


def health_of_runs(paths: list[Path], *, judge: str | None = None, match: str = "title",
                   alpha: float = ALPHA, min_steps: int = MIN_STEPS) -> JudgeHealth:
    """Judge health over the run folders' train steps (nothing written)."""
    if match not in ("title", "id"):
        raise UsageError(f"--match {match!r}: choose title or id")
    if not 0 < alpha < 1:
        raise UsageError(f"--alpha {alpha}: give a level between 0 and 1")
    if min_steps < 3:
        raise UsageError(f"--min-steps {min_steps}: a trend test needs at least 3 steps")
    v, r, w, b, spot = read_health_inputs(paths, judge)
    return judge_health(v, r, w, b, match=match, alpha=alpha, min_steps=min_steps,
                        spot_checks=spot)


def audit_judge_health(paths: list[Path], out: Path, *, judge: str | None = None,
                       match: str = "title", alpha: float = ALPHA, min_steps: int = MIN_STEPS,
                       force: bool = False) -> JudgeHealth:
    """Judge health → ``out/judge_health_{steps,criteria,trends}.parquet``."""
    from draco_cli.audit.stage import _refuse_existing
    from draco_cli.publish import publish_tables
    from draco_cli.schemas import JudgeHealthCriterion, JudgeHealthStep, JudgeHealthTrend

    _refuse_existing(out, HEALTH_NAMES, force)
    h = health_of_runs(paths, judge=judge, match=match, alpha=alpha, min_steps=min_steps)
    t = publish_tables(out, {"judge_health_steps": (h.steps, JudgeHealthStep),
                             "judge_health_criteria": (h.criteria, JudgeHealthCriterion),
                             "judge_health_trends": (h.trends, JudgeHealthTrend)},
                       force=force)
    return JudgeHealth(t["judge_health_steps"], t["judge_health_criteria"],
                       t["judge_health_trends"], alpha, min_steps)
