"""Judge health in the training loop: the same figures and flag as ``draco audit
judge-health``, over the ``StepResult`` history a trainer keeps, with the outcomes it knows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import polars as pl

from draco_cli.audit.judge_health import ALPHA, MIN_STEPS, JudgeHealth, judge_health
from draco_cli.errors import UsageError
from draco_cli.inloop.step import StepResult


def judge_health_history(results: Sequence[StepResult],
                         outcomes: Sequence[Mapping[str, float | None]], *,
                         match: str = "title", alpha: float = ALPHA,
                         min_steps: int = MIN_STEPS) -> JudgeHealth:
    """Judge health over training steps scored in-loop: ``results[i]`` a step's result and
    ``outcomes[i]`` its rollouts' environment outcomes by rollout id (None: no outcome). A
    result without a train step takes its place in the history as its step. Rollouts of a
    group that fell back (not scored) are left out."""
    if len(results) != len(outcomes):
        raise UsageError(f"judge_health_history: {len(results)} step results but "
                         f"{len(outcomes)} outcome maps: give one per step")
    vs, rs, ws, bs, ss = [], [], [], [], []
    seen: set[int] = set()
    for i, (res, out) in enumerate(zip(results, outcomes)):
        step = res.train_step if res.train_step is not None else i
        if step in seen:
            raise UsageError(f"judge_health_history: train step {step} given twice")
        seen.add(step)
        t = res.tables(("verdicts", "rewards", "rubrics"))   # not the token tables: large
        tag = pl.lit(step, pl.Int64).alias("train_step")
        if not t["verdicts"].height or not t["rewards"].height:
            continue
        groups = t["rewards"].select("rollout_id", "group_id")
        vs.append(t["verdicts"].select("rollout_id", "criterion_id", "verdict")
                  .with_columns(tag))
        ws.append(t["rewards"].select("rollout_id", pl.col("reward").cast(pl.Float64))
                  .with_columns(tag))
        rs.append(groups.with_columns(
            pl.col("rollout_id").replace_strict(dict(out), default=None,
                                                return_dtype=pl.Float64).alias("outcome"), tag))
        if t["rubrics"].height and "title" in t["rubrics"].columns:
            bs.append(t["rubrics"].select("group_id", "criterion_id", "title").with_columns(tag))
        if res.spot_checks is not None and res.spot_checks.height:   # spot_check=N
            ss.append(res.spot_checks.with_columns(tag))
    if not vs:
        raise UsageError("judge_health_history: no scored step (every group fell back)")
    return judge_health(pl.concat(vs), pl.concat(rs), pl.concat(ws),
                        pl.concat(bs) if bs else None, match=match, alpha=alpha,
                        min_steps=min_steps, spot_checks=pl.concat(ss) if ss else None)
