"""Judge health in the training loop: the same figures and flag as ``draco audit
judge-health``, over the ``StepResult`` history a trainer keeps, with the outcomes it knows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import polars as pl

from draco_cli.audit.judge_health import (ALPHA, MIN_STEPS, JudgeHealth, health_of,
                                          step_figures)
from draco_cli.errors import UsageError
from draco_cli.inloop.step import StepResult


class JudgeHealthHistory:
    """``judge_health_history`` kept step by step: each step's figures are computed once (at
    the first ``health()`` after its ``add``), and ``health()`` fits the trends over every
    step so far, so asking after each step costs the new steps' figures and the trends, not
    the whole history again."""

    def __init__(self, *, match: str = "title") -> None:
        self.match = match
        self._added = 0
        self._seen: set[int] = set()
        # the tables of steps added since the last health(): verdicts, rollouts, rewards,
        # rubrics, spot checks
        self._new: tuple[list[pl.DataFrame], ...] = ([], [], [], [], [])
        self._steps: list[pl.DataFrame] = []
        self._criteria: list[pl.DataFrame] = []
        self._spot = False

    def add(self, result: StepResult, outcomes: Mapping[str, float | None]) -> None:
        """A step's result and its rollouts' environment outcomes by rollout id (None: no
        outcome). A result without a train step takes its place in the history as its step.
        Rollouts of a group that fell back (not scored) are left out."""
        step = result.train_step if result.train_step is not None else self._added
        if step in self._seen:
            raise UsageError(f"judge_health_history: train step {step} given twice")
        t = result.tables(("verdicts", "rewards", "rubrics"))   # not the token tables: large
        tag = pl.lit(step, pl.Int64).alias("train_step")
        scored = bool(t["verdicts"].height and t["rewards"].height)
        if scored:   # every frame built before any is kept: a step that fails leaves no trace
            frames = (
                t["verdicts"].select("rollout_id", "criterion_id", "verdict").with_columns(tag),
                t["rewards"].select("rollout_id", "group_id").with_columns(
                    pl.col("rollout_id").replace_strict(dict(outcomes), default=None,
                                                        return_dtype=pl.Float64)
                    .alias("outcome"), tag),
                t["rewards"].select("rollout_id", pl.col("reward").cast(pl.Float64))
                .with_columns(tag),
                t["rubrics"].select("group_id", "criterion_id", "title").with_columns(tag)
                if t["rubrics"].height and "title" in t["rubrics"].columns else None,
                result.spot_checks.with_columns(tag)   # spot_check=N
                if result.spot_checks is not None and result.spot_checks.height else None)
        self._added += 1
        self._seen.add(step)
        if scored:
            for kept, frame in zip(self._new, frames):
                if frame is not None:
                    kept.append(frame)

    def health(self, *, alpha: float = ALPHA, min_steps: int = MIN_STEPS) -> JudgeHealth:
        vs, rs, ws, bs, ss = self._new
        if vs:   # the new steps' figures, in one pass over their tables
            steps, criteria = step_figures(
                pl.concat(vs), pl.concat(rs), pl.concat(ws), pl.concat(bs) if bs else None,
                match=self.match, spot_checks=pl.concat(ss) if ss else None)
            self._steps.append(steps)
            self._criteria.append(criteria)
            self._spot = self._spot or bool(ss)
            self._new = ([], [], [], [], [])
        if not self._steps:
            raise UsageError("judge_health_history: no scored step (every group fell back)")
        # one frame per table again, so the next call concatenates one more step, not all
        self._steps = [pl.concat(self._steps).sort("train_step")]
        self._criteria = [pl.concat(self._criteria).sort("criterion", "train_step")]
        # clones: a caller changing the returned tables in place leaves the history's alone
        return health_of(self._steps[0].clone(), self._criteria[0].clone(), spot=self._spot,
                         alpha=alpha, min_steps=min_steps)


def judge_health_history(results: Sequence[StepResult],
                         outcomes: Sequence[Mapping[str, float | None]], *,
                         match: str = "title", alpha: float = ALPHA,
                         min_steps: int = MIN_STEPS) -> JudgeHealth:
    """Judge health over training steps scored in-loop: ``results[i]`` a step's result and
    ``outcomes[i]`` its rollouts' environment outcomes by rollout id (None: no outcome). A
    result without a train step takes its place in the history as its step. Rollouts of a
    group that fell back (not scored) are left out. A trainer asking every step keeps a
    ``JudgeHealthHistory`` instead."""
    if len(results) != len(outcomes):
        raise UsageError(f"judge_health_history: {len(results)} step results but "
                         f"{len(outcomes)} outcome maps: give one per step")
    history = JudgeHealthHistory(match=match)
    for res, out in zip(results, outcomes):
        history.add(res, out)
    return history.health(alpha=alpha, min_steps=min_steps)
