"""The measurements the CREDO paper asks to report (§5): weight tails, variance split, allocator
calibration, predictor drift. See docs/credo.md, "Diagnostics". Totals are inverse-inclusion
weighted so they estimate sums over all planned positions, not just the replayed ones.

Cost by category is ``audit.cost.cost_categories`` (the audit and the report share it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import polars as pl

if TYPE_CHECKING:
    from draco_cli.credo.heads import Heads

from draco_cli.credo.correction import deltas
from draco_cli.errors import InputError
from draco_cli.schemas import AllocatorCalibration, polars_schema


def _labelled(plan_df: pl.DataFrame, labels: pl.DataFrame) -> pl.DataFrame:
    """Selected positions with Δ, side means, side variances and K per side."""

    d, _ = deltas(plan_df, labels)  # validates labels, refuses incomplete positions
    lab = labels.with_columns(pl.col("step").cast(pl.Int64))
    side = lab.group_by("rollout_id", "step").agg(
        *[agg for s in ("realized", "resampled") for agg in (
            pl.col("return").filter(pl.col("side") == s).var(ddof=1).alias(f"var_{s}"),
            pl.col("return").filter(pl.col("side") == s).len().alias(f"k_{s}"))])
    return plan_df.filter(pl.col("selected")).select(
        "rollout_id", pl.col("step").cast(pl.Int64), "p", "prediction", "error").join(
        d, on=["rollout_id", "step"]).join(side, on=["rollout_id", "step"], how="left")


def weight_tails(plan_df: pl.DataFrame) -> dict[str, Any]:
    """Importance weights S_t/p_t over the replayed positions."""
    sel = plan_df.filter(pl.col("selected"))
    w = 1.0 / sel["p"].to_numpy() if sel.height else np.zeros(0)
    ess = float(w.sum() ** 2 / (w ** 2).sum()) if w.size else 0.0
    return {"positions": plan_df.height, "replayed": int(sel.height),
            "max_weight": float(w.max()) if w.size else None,
            "mean_weight": float(w.mean()) if w.size else None,
            "effective_sample_size": ess,
            "ess_share": ess / w.size if w.size else None,
            # p is a float column: its minimum is a float
            "min_p": float(cast(float, plan_df["p"].min())) if plan_df.height else None,
            "top_weight_share": float(w.max() / w.sum()) if w.size else None}


def variance_split(plan_df: pl.DataFrame, labels: pl.DataFrame) -> dict[str, Any]:
    """Replay noise σ_t² vs squared prediction error (C_t − c_t)², inverse-inclusion weighted
    totals over all planned positions (positions with one return per side have no σ̂²)."""
    rows = _labelled(plan_df, labels)
    ok = rows.filter((pl.col("k_realized") >= 2) & (pl.col("k_resampled") >= 2))
    if ok.height == 0:
        return {"positions": 0, "noise": None, "prediction_error": None, "noise_share": None,
                "note": "needs at least 2 returns per side to measure replay noise"}
    w = 1.0 / ok["p"].to_numpy()
    sigma2 = (ok["var_realized"].to_numpy() / ok["k_realized"].to_numpy()
              + ok["var_resampled"].to_numpy() / ok["k_resampled"].to_numpy())
    resid2 = (ok["delta"].to_numpy() - ok["prediction"].to_numpy()) ** 2
    noise = float((w * sigma2).sum())
    err = float((w * (resid2 - sigma2)).sum())  # unbiased for Σ (C_t − c_t)²; may dip < 0
    total = noise + max(err, 0.0)
    return {"positions": ok.height, "noise": noise, "prediction_error": err,
            "noise_share": noise / total if total > 0 else None,
            "note": "σ² = s²_real/K + s²_res/K; (C − c)² estimated as (Δ − c)² − σ̂²"}


def allocator_calibration(plan_df: pl.DataFrame, labels: pl.DataFrame, bins: int = 5
                          ) -> pl.DataFrame:
    """Predicted e_t (what the allocator used) vs realized (Δ_t − c_t)² per e-bin."""
    rows = _labelled(plan_df, labels)
    schema = polars_schema(AllocatorCalibration)
    if rows.height == 0:
        return pl.DataFrame(schema=schema)
    from draco_cli.credo.heads import weighted_bins

    return weighted_bins(rows["error"], (rows["delta"] - rows["prediction"]) ** 2, 1 / rows["p"],
                         bins).rename({"mean_prediction": "mean_predicted_error",
                                       "mean_target": "mean_squared_residual"}).cast(schema)


def predictor_drift(old: Heads, new: Heads, features: pl.DataFrame) -> dict[str, Any]:
    """How much the predictions moved between two head versions on the same positions."""
    c0, e0 = old.predict(features)
    c1, e1 = new.predict(features)
    if c0.size == 0:
        raise InputError("no positions in the features table", field="step")
    d = c1 - c0
    corr = float(np.corrcoef(c0, c1)[0, 1]) if c0.size > 1 and c0.std() > 0 and c1.std() > 0 \
        else None
    return {"from": old.version, "to": new.version, "positions": int(c0.size),
            "mean_abs_change": float(np.abs(d).mean()), "rms_change": float(np.sqrt((d ** 2)
                                                                                   .mean())),
            "max_abs_change": float(np.abs(d).max()), "correlation": corr,
            "mean_error_before": float(e0.mean()), "mean_error_after": float(e1.mean())}
