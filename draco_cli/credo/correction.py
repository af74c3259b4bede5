"""The correction (SPEC §6, Eq. 6): Δ_t from the two-sided replay labels, and
Ĉ_t = c_t + (S_t/p_t)(Δ_t − c_t), unbiased for C_t for any fixed c_t; the terminal RLOO part."""

from __future__ import annotations

from typing import Any

import polars as pl

from draco_cli.errors import InputError, UsageError

def deltas(plan_df: pl.DataFrame, labels: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """Δ_t = mean realized return − mean resampled return for every selected position.
    Returns (rollout_id, step, delta) and the count of labels ignored (unselected positions)."""
    for col in ("rollout_id", "step", "side", "return"):
        if col not in labels.columns:
            raise InputError("missing column of the labels table", field=col)
    bad = labels.with_row_index("__r").filter(~pl.col("side").is_in(["realized", "resampled"]))
    if bad.height:
        raise InputError(f"side must be realized or resampled, got {bad['side'][0]!r}",
                         row=int(bad["__r"][0]), field="side")
    lab = labels.with_columns(pl.col("step").cast(pl.Int64))
    if "sample" in lab.columns:
        key = ["rollout_id", "step", "side", "sample"]
        clash = lab.with_row_index("__r").group_by(key).agg(
            pl.col("return").n_unique().alias("__v"), pl.col("__r").min()).filter(
            pl.col("__v") > 1)
        if clash.height:
            r = clash.sort("__r").row(0, named=True)
            raise InputError(f"conflicting duplicate labels: ({r['rollout_id']!r}, step "
                             f"{r['step']}, {r['side']}, sample {r['sample']}) has different "
                             f"returns ({clash.height} such key(s))", row=int(r["__r"]),
                             field="return")
        lab = lab.unique(subset=key, keep="first", maintain_order=True)
    sel = plan_df.filter(pl.col("selected")).select("rollout_id", "step")
    ignored = lab.join(sel, on=["rollout_id", "step"], how="anti").height
    lab = lab.join(sel, on=["rollout_id", "step"], how="inner")
    sides = lab.group_by("rollout_id", "step").agg(
        pl.col("return").filter(pl.col("side") == "realized").mean().alias("real"),
        pl.col("return").filter(pl.col("side") == "resampled").mean().alias("res"))
    full = sel.join(sides, on=["rollout_id", "step"], how="left")
    missing = full.filter(pl.col("real").is_null() | pl.col("res").is_null())
    if missing.height:
        r = missing.row(0, named=True)
        side = "realized" if r["real"] is None else "resampled"
        raise InputError(f"selected position ({r['rollout_id']!r}, step {r['step']}) has no "
                         f"{side} labels ({missing.height} selected position(s) incomplete)",
                         field="side")
    return full.select("rollout_id", "step", (pl.col("real") - pl.col("res")).alias("delta")), \
        ignored


def rloo(rollouts: pl.DataFrame) -> pl.DataFrame:
    """Unstandardised RLOO of the outcome within each group: A_i = r_i − mean of the others."""
    r = pl.col("outcome")
    n = r.count().over("group_id")
    adv = pl.when(r.is_null() | (n <= 1)).then(0.0).otherwise(
        r - (r.sum().over("group_id") - r) / (n - 1))
    return rollouts.select("rollout_id", adv.alias("rloo"))


def correct(plan_df: pl.DataFrame, labels: pl.DataFrame, *, beta: float = 0.0,
            rollouts: pl.DataFrame | None = None, no_correction: bool = False,
            clip: float | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Per-position corrected credit and advantage a_t = β·A_RLOO + (1 − β)·Ĉ_t."""
    if not 0 <= beta <= 1:
        raise UsageError("--beta must be in [0, 1]")
    if clip is not None and not clip > 0:
        raise UsageError(f"--clip must be > 0 (got {clip:g}): Ĉ_t is clipped to ±CLIP")
    if beta > 0 and rollouts is None:
        raise UsageError("--beta > 0 mixes in the rollouts' RLOO outcome: pass --rollouts")
    d, ignored = deltas(plan_df, labels)
    out = plan_df.select("rollout_id", pl.col("step").cast(pl.Int64), "prediction", "p",
                         "selected").join(d, on=["rollout_id", "step"], how="left",
                                          maintain_order="left")
    c, S, p, delta = pl.col("prediction"), pl.col("selected"), pl.col("p"), pl.col("delta")
    corrected = c if no_correction else pl.when(S).then(c + (delta - c) / p).otherwise(c)
    out = out.with_columns(corrected.alias("corrected"))
    if clip is not None:
        out = out.with_columns(pl.col("corrected").clip(-clip, clip))
    if beta > 0 and rollouts is not None:   # not None: checked above
        out = out.join(rloo(rollouts), on="rollout_id", how="left", maintain_order="left") \
            .with_columns(pl.col("rloo").fill_null(0.0))
        out = out.with_columns((beta * pl.col("rloo") + (1 - beta) * pl.col("corrected"))
                               .alias("advantage"))
    else:
        out = out.with_columns(pl.lit(0.0).alias("rloo"), pl.col("corrected").alias("advantage"))
    info = {"labels_ignored": ignored, "selected": int(out["selected"].sum()),
            "positions": out.height, "correction": not no_correction, "clip": clip,
            "beta": beta}
    return out, info
