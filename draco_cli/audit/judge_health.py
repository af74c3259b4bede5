"""Judge health over training: does the training judge's pass rate climb while the outcome
does not? See docs/audits.md, "draco audit judge-health".

Every test takes one train step as one observation (SPEC §4) because a step's verdicts are not
independent: they share its rollouts, rubric and judge state. Trends come from
``draco_cli.audit.stats.step_trend``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from draco_cli.audit.spot_agreement import SPOT_STEP_SCHEMA, spot_per_step, spot_scope_row
from draco_cli.audit.stats import Trend, trend
from draco_cli.schemas import (JudgeHealthCriterion, JudgeHealthStep, JudgeHealthTrend,
                               polars_schema)

ALPHA = 0.05
MIN_STEPS = 3

STEP_SCHEMA = polars_schema(JudgeHealthStep)
CRITERION_SCHEMA = polars_schema(JudgeHealthCriterion)
TREND_SCHEMA = polars_schema(JudgeHealthTrend)


@dataclass
class JudgeHealth:
    steps: pl.DataFrame      # one row per train step (aggregate over every criterion)
    criteria: pl.DataFrame   # one row per criterion and train step
    trends: pl.DataFrame     # one row for the run, one per criterion: trends and the flag
    alpha: float = ALPHA
    min_steps: int = MIN_STEPS

    @property
    def flagged(self) -> pl.DataFrame:
        return self.trends.filter(pl.col("flagged"))


def normalise_title(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def holm(p: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment over the p-values that exist (None stays None)."""
    idx = sorted((i for i, v in enumerate(p) if v is not None), key=lambda i: p[i] or 0.0)
    m, running = len(idx), 0.0
    adjusted: list[float | None] = [None] * len(p)
    for rank, i in enumerate(idx):
        v = p[i]
        assert v is not None
        running = max(running, min(1.0, (m - rank) * v))
        adjusted[i] = running
    return adjusted


def _agreement(rw: pl.DataFrame) -> tuple[int, float | None]:
    """Within-group pairs of rollouts with different outcomes, and the share the reward orders
    as the outcome does (ties half): the same figure as the report's per-step table."""
    pairs, score = 0, 0.0
    ok = rw.filter(pl.col("reward").is_not_null() & pl.col("outcome").is_not_null()) \
        .sort("group_id", maintain_order=True)
    # each group a slice of the sorted arrays (a polars frame per group cost ~0.2 ms each)
    gid, rs, os_ = (ok[c].to_numpy() for c in ("group_id", "reward", "outcome"))
    cuts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1], True])
    for a, b in zip(cuts[:-1], cuts[1:]):
        r, o = rs[a:b], os_[a:b]
        i, j = np.triu_indices(len(r), k=1)
        keep = o[i] != o[j]
        i, j = i[keep], j[keep]
        pairs += int(i.size)
        d = (r[i] - r[j]) * (o[i] - o[j])
        score += float(np.sum(d > 0) + 0.5 * np.sum(r[i] == r[j]))
    return pairs, (score / pairs if pairs else None)


def _correlation(rw: pl.DataFrame) -> float | None:
    ok = rw.filter(pl.col("reward").is_not_null() & pl.col("outcome").is_not_null())
    if ok.height < 2 or ok["reward"].std() == 0 or ok["outcome"].std() == 0:
        return None
    return float(np.corrcoef(ok["reward"].to_numpy(), ok["outcome"].to_numpy())[0, 1])


def judge_health(verdicts: pl.DataFrame, rollouts: pl.DataFrame,
                 rewards: pl.DataFrame | None = None, rubrics: pl.DataFrame | None = None, *,
                 match: str = "title", alpha: float = ALPHA, min_steps: int = MIN_STEPS,
                 spot_checks: pl.DataFrame | None = None) -> JudgeHealth:
    """Judge health from tables that carry ``train_step``: verdicts (rollout_id,
    criterion_id, verdict), rollouts (rollout_id, group_id, outcome), optional rewards
    (rollout_id, reward), rubrics (group_id, criterion_id, title; for ``match="title"``) and
    ``spot_checks`` (``draco run --spot-check``). The flag rules: docs/audits.md."""
    steps, crit = step_figures(verdicts, rollouts, rewards, rubrics, match=match,
                               spot_checks=spot_checks)
    return health_of(steps, crit, spot=spot_checks is not None and spot_checks.height > 0,
                     alpha=alpha, min_steps=min_steps)


def step_figures(verdicts: pl.DataFrame, rollouts: pl.DataFrame,
                 rewards: pl.DataFrame | None = None, rubrics: pl.DataFrame | None = None, *,
                 match: str = "title", spot_checks: pl.DataFrame | None = None
                 ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The steps and criteria tables of ``judge_health``: each train step's rows depend on
    that step's tables alone, so a history can compute them once per step."""
    ro = rollouts.select("train_step", "rollout_id", "group_id",
                         pl.col("outcome").cast(pl.Float64))
    v = verdicts.select("train_step", "rollout_id", "criterion_id", "verdict").join(
        ro, on=["train_step", "rollout_id"], how="inner")
    title = pl.col("criterion_id")
    if rubrics is not None and rubrics.height:
        rb = rubrics.select("train_step", "group_id", "criterion_id", "title").unique(
            ["train_step", "group_id", "criterion_id"], keep="first")
        v = v.join(rb, on=["train_step", "group_id", "criterion_id"], how="left")
        title = pl.coalesce("title", "criterion_id")
    v = v.with_columns(title.alias("title"))
    # each distinct title normalised once (not once per verdict)
    key = (pl.col("title").replace_strict(
        {t: normalise_title(t) for t in v["title"].drop_nulls().unique().to_list()},
        default=None, return_dtype=pl.String) if match == "title" else pl.col("criterion_id"))
    v = v.with_columns(key.alias("criterion"))
    judged = v.filter(pl.col("verdict").is_in(["pass", "fail"]))
    steps_all = sorted(set(ro["train_step"].drop_nulls().to_list()))

    def by_step(df: pl.DataFrame) -> Callable[[int], pl.DataFrame]:
        """A step's rows, the table split once (filtering it per step is quadratic)."""
        parts = {k[0]: part for k, part in df.partition_by("train_step", as_dict=True).items()}
        return lambda s: parts.get(s, df.clear())

    ro_of, judged_of, v_of = by_step(ro), by_step(judged), by_step(v)
    rewards_of = by_step(rewards) if rewards is not None else None
    step_rows = []
    for s in steps_all:
        r_s, j_s = ro_of(s), judged_of(s)
        rw = (rewards_of(s).select("rollout_id", "reward").join(r_s, on="rollout_id")
              if rewards_of is not None else None)
        pairs, agree = _agreement(rw) if rw is not None else (0, None)
        n_out = int(r_s["outcome"].is_not_null().sum())
        step_rows.append({
            "train_step": s, "rollouts": r_s.height, "outcome_n": n_out,
            "outcome_rate": float(r_s["outcome"].mean()) if n_out else None,  # type: ignore[arg-type]
            "verdicts": j_s.height,
            "pass_rate": int((j_s["verdict"] == "pass").sum()) / j_s.height if j_s.height
            else None,
            "criteria": v_of(s)["criterion"].n_unique(),
            "mean_reward": float(rw["reward"].mean())  # type: ignore[arg-type]
            if rw is not None and rw["reward"].is_not_null().any() else None,
            "pairs": pairs, "agreement": agree,
            "correlation": _correlation(rw) if rw is not None else None})
    steps = pl.DataFrame(step_rows, schema={k: STEP_SCHEMA[k] for k in STEP_SCHEMA
                                            if k not in SPOT_STEP_SCHEMA}).join(
        spot_per_step(spot_checks, steps_all), on="train_step", how="left",
        maintain_order="left").select(list(STEP_SCHEMA))

    crit = v.group_by("criterion", "train_step").agg(
        pl.col("title").first(), pl.col("group_id").n_unique().alias("groups"),
        (pl.col("verdict").is_in(["pass", "fail"])).sum().cast(pl.Int64).alias("n"),
        (pl.col("verdict") == "pass").sum().cast(pl.Int64).alias("passes"),
        (pl.col("verdict") == "na").sum().cast(pl.Int64).alias("na"),
        pl.col("verdict").is_null().sum().cast(pl.Int64).alias("unanswered"),
        pl.col("outcome").filter(pl.col("verdict").is_in(["pass", "fail"])).mean()
        .alias("outcome_rate"),
        *[((pl.col("verdict") == "pass") & (pl.col("outcome") == o)).sum().alias(f"__p{o}")
          for o in (0, 1)],
        *[(pl.col("verdict").is_in(["pass", "fail"]) & (pl.col("outcome") == o)).sum()
          .alias(f"__n{o}") for o in (0, 1)],
    ).with_columns(
        (pl.col("passes") / pl.col("n")).alias("pass_rate"),
        (pl.col("__p1") / pl.col("__n1")).alias("pass_rate_success"),
        (pl.col("__p0") / pl.col("__n0")).alias("pass_rate_failure"),
    ).with_columns(pl.col(c).fill_nan(None) for c in
                   ("pass_rate", "pass_rate_success", "pass_rate_failure", "outcome_rate")
    ).select(list(CRITERION_SCHEMA)).cast(pl.Schema(CRITERION_SCHEMA)).sort("criterion", "train_step")
    return steps, crit


def health_of(steps: pl.DataFrame, crit: pl.DataFrame, *, spot: bool, alpha: float = ALPHA,
              min_steps: int = MIN_STEPS) -> JudgeHealth:
    """The trends and flags over ``step_figures``' tables (``spot``: spot checks were given)."""
    p_t = trend(list(zip(steps["train_step"], steps["pass_rate"], steps["verdicts"])))
    o_t = trend(list(zip(steps["train_step"], steps["outcome_rate"], steps["outcome_n"])))
    a_t = trend(list(zip(steps["train_step"], steps["agreement"], steps["pairs"])))
    run = _scope_row("run", None, None, steps.filter(pl.col("verdicts") > 0), p_t, o_t, p_t.p,
                     alpha, min_steps)
    trends = [run | {"agreement_slope": a_t.slope, "agreement_p": a_t.p}]
    if spot:   # the run's pass-rate trend beside the agreement with the gold judge
        trends.append(spot_scope_row(steps, p_t, alpha, min_steps))
    rows = []
    for (c,), g in crit.filter(pl.col("n") > 0).group_by("criterion", maintain_order=True):
        p_t = trend(list(zip(g["train_step"], g["pass_rate"], g["n"])))
        o_n = (g["n"] * g["outcome_rate"].is_not_null()).to_list()
        o_t = trend(list(zip(g["train_step"], g["outcome_rate"], o_n)))
        rows.append((str(c), g, p_t, o_t))
    tested = [p.p if g.height >= min_steps else None for _, g, p, _ in rows]
    for (c, g, p_t, o_t), p_adj in zip(rows, holm(tested)):
        trends.append(_scope_row("criterion", c, g["title"][0], g, p_t, o_t, p_adj, alpha,
                                 min_steps))
    return JudgeHealth(steps, crit, pl.DataFrame(trends, schema=TREND_SCHEMA), alpha,
                       min_steps)


def _scope_row(scope: str, criterion: str | None, title: str | None, g: pl.DataFrame,
               p_t: Trend, o_t: Trend, p_used: float | None, alpha: float, min_steps: int
               ) -> dict[str, Any]:
    rates = g["pass_rate"].to_list()
    n = g.height
    outcome_rises = (o_t.slope or 0) > 0 and o_t.p is not None and o_t.p < alpha
    flagged = (n >= min_steps and p_used is not None and p_used < alpha
               and (p_t.slope or 0) > 0 and not outcome_rises)
    if n < min_steps:
        reason = f"not tested: {n} step(s) with verdicts, fewer than {min_steps}"
    elif p_t.slope is None or p_used is None:
        reason = "not tested: the trend cannot be computed"
    else:
        what = "p_holm" if scope == "criterion" else "p"
        out = ("the outcome: no trend" if o_t.slope is None else
               f"the outcome {o_t.slope:+.4f}/step (p={o_t.p:.3g})")
        reason = (f"pass rate {p_t.slope:+.4f}/step ({what}={p_used:.3g}), {out}"
                  + ("; flagged: the judge passes more while the outcome does not rise"
                     if flagged else ""))
    return {"scope": scope, "criterion": criterion, "title": title, "n_steps": n,
            "pass_rate_first": rates[0] if rates else None,
            "pass_rate_last": rates[-1] if rates else None, "pass_slope": p_t.slope,
            "pass_t": None if p_t.t is None or math.isinf(p_t.t) else p_t.t,
            "pass_p": p_t.p, "pass_p_holm": p_used if scope == "criterion" else None,
            "outcome_slope": o_t.slope, "outcome_p": o_t.p, "agreement_slope": None,
            "agreement_p": None, "flagged": flagged, "reason": reason}
