"""Rubric evolution by scoring (SPEC §6): candidate feature tables, one per rubric edit, scored
on held-out tasks by the variance-weighted objective Σ (S/p)((1 − p)/p)‖g‖²(Δ − c)², with
ordinary MSE alongside. LLM-proposed edits build on this in ``draco_cli.credo.propose``."""

from __future__ import annotations

import numpy as np
import polars as pl

from draco_cli.credo.heads import fit_heads, task_split, training_rows
from draco_cli.errors import UsageError

def objective(rows: pl.DataFrame, c: np.ndarray) -> tuple[float, float]:
    """(variance-weighted objective Σ (S/p)((1−p)/p)‖g‖²(Δ − c)², ordinary MSE) over selected
    held-out rows (S = 1 there)."""
    p = rows["p"].to_numpy()
    g = rows["score_norm"].to_numpy() if "score_norm" in rows.columns else np.ones_like(p)
    r2 = (rows["delta"].to_numpy() - c) ** 2
    return float(np.sum((1 / p) * ((1 - p) / p) * g ** 2 * r2)), float(np.mean(r2))


def evolve(plan_df: pl.DataFrame, labels: pl.DataFrame, rollouts: pl.DataFrame,
           candidates: dict[str, pl.DataFrame], ridge: float = 1.0, holdout: float = 0.2
           ) -> pl.DataFrame:
    """Score rubric variants (each a features table computed under one rubric edit; 'baseline'
    is the current rubric): fit the credit head on training tasks, evaluate on held-out tasks.
    Lower objective is better; accept the best only if it beats the baseline."""
    train, held = task_split(rollouts, holdout)
    out = []
    for name, F in candidates.items():
        rows = training_rows(plan_df, labels, F)
        tr = rows.filter(pl.col("rollout_id").is_in(list(train)))
        te = rows.filter(pl.col("rollout_id").is_in(list(held)))
        if tr.height == 0 or te.height == 0:
            raise UsageError("the task split left no labelled position on one side; label more "
                             "positions or change --holdout")
        h = fit_heads(plan_df.filter(pl.col("rollout_id").is_in(list(train))), labels, F, ridge)
        c, _ = h.predict(te)
        obj, mse = objective(te.join(plan_df.select("rollout_id", pl.col("step").cast(pl.Int64),
                                                    "score_norm"), on=["rollout_id", "step"],
                                     how="left") if "score_norm" in plan_df.columns else te, c)
        out.append({"candidate": name, "held_out_objective": obj, "held_out_mse": mse,
                    "train_rows": tr.height, "held_out_rows": te.height})
    df = pl.DataFrame(out).sort("held_out_objective")
    base = df.filter(pl.col("candidate") == "baseline")
    best = df.row(0, named=True)
    accept = base.height == 0 or best["held_out_objective"] < base["held_out_objective"][0]
    return df.with_columns(((pl.col("candidate") == best["candidate"]) & pl.lit(accept))
                           .alias("accepted"))
