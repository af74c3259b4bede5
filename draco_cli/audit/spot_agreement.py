"""The training judge against the gold judge of ``draco run --spot-check N``, per train step:
agreement, Cohen's kappa, both pass rates, and the flag for agreement falling while the pass
rate rises. See docs/audits.md, "Spot checks against a gold judge"."""

from __future__ import annotations

from typing import Any

import polars as pl

from draco_cli.audit.stats import Trend, trend
from draco_cli.schemas import JudgeHealthStep, polars_schema

SPOT_STEP_SCHEMA = {name: dtype for name, dtype in polars_schema(JudgeHealthStep).items()
                    if name.startswith("spot_")}


def cohen_kappa(a: list[str], b: list[str]) -> float | None:
    """Cohen's kappa of two raters over the same items; None when undefined (no items, or
    chance agreement 1)."""
    n = len(a)
    if n == 0 or n != len(b):
        return None
    po = sum(x == y for x, y in zip(a, b)) / n
    cats = set(a) | set(b)
    pe = sum((a.count(c) / n) * (b.count(c) / n) for c in cats)
    if pe >= 1.0:
        return None
    return (po - pe) / (1.0 - pe)


def _pass_rate(passes: pl.Series) -> float | None:
    p = passes.drop_nulls()
    return float(p.sum()) / p.len() if p.len() else None


def spot_per_step(spot: pl.DataFrame | None, steps: list[int]) -> pl.DataFrame:
    """One row per train step of ``steps``: spot_n (rows the gold judge answered),
    spot_agreement, spot_kappa, spot_judge_pass_rate, spot_gold_pass_rate (pass / (pass +
    fail) on those rows; na left out). A step without spot checks has spot_n 0 and nulls."""
    rows: list[dict[str, Any]] = []
    for s in steps:
        d = (spot.filter((pl.col("train_step") == s) & pl.col("gold_verdict").is_not_null())
             if spot is not None and spot.height else None)
        if d is None or not d.height:
            rows.append({"train_step": s, "spot_n": 0})
            continue
        a, b = d["judge_verdict"].to_list(), d["gold_verdict"].to_list()
        rows.append({"train_step": s, "spot_n": d.height,
                     "spot_agreement": sum(x == y for x, y in zip(a, b)) / d.height,
                     "spot_kappa": cohen_kappa(a, b),
                     "spot_judge_pass_rate": _pass_rate(d["judge_pass"]),
                     "spot_gold_pass_rate": _pass_rate(d["gold_pass"])})
    return pl.DataFrame(rows, schema={"train_step": pl.Int64, **SPOT_STEP_SCHEMA})


def spot_scope_row(steps: pl.DataFrame, pass_t: Trend, alpha: float, min_steps: int
                   ) -> dict[str, Any]:
    """The trends row of scope ``spot_check``: the agreement's step-level trend (weights:
    rows checked) beside the training judge's pass-rate trend over all its verdicts
    (``pass_t``). Flagged over ≥ ``min_steps`` steps with spot checks when the agreement
    falls (slope < 0, p < alpha) while the pass rate rises (slope > 0, p < alpha)."""
    g = steps.filter(pl.col("spot_n") > 0)
    a_t = trend(list(zip(g["train_step"], g["spot_agreement"], g["spot_n"])))
    n = g.height
    falls = (a_t.slope or 0) < 0 and a_t.p is not None and a_t.p < alpha
    rises = (pass_t.slope or 0) > 0 and pass_t.p is not None and pass_t.p < alpha
    flagged = n >= min_steps and falls and rises
    if n < min_steps:
        reason = f"not tested: {n} step(s) with spot checks, fewer than {min_steps}"
    elif a_t.slope is None:
        reason = "not tested: the agreement trend cannot be computed"
    else:
        judge = ("the judge's pass rate: no trend" if pass_t.slope is None else
                 f"the judge's pass rate {pass_t.slope:+.4f}/step (p={pass_t.p:.3g})")
        reason = (f"agreement with the gold judge {a_t.slope:+.4f}/step (p={a_t.p:.3g}), "
                  f"{judge}" + ("; flagged: the training judge passes more while it agrees "
                                "less with the gold judge" if flagged else ""))
    # pass_rate_first/last stay null: the per-step agreement is in the steps table
    return {"scope": "spot_check", "n_steps": n, "pass_slope": pass_t.slope,
            "pass_p": pass_t.p, "agreement_slope": a_t.slope, "agreement_p": a_t.p,
            "flagged": flagged, "reason": reason}
