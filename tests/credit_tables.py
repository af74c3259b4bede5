"""Step credit and token advantages from in-memory tables, composed from the library's own
array functions as ``compute_credit``, ``credit compute`` and the in-loop scorer compose them:
the tests' shorthand for one stage at a time."""

from __future__ import annotations

import numpy as np
import polars as pl

from draco_cli.credit.core import citation_arrays, step_credit_arrays, step_credit_frame
from draco_cli.credit.inputs import index_steps
from draco_cli.credit.tokens import token_spans


def step_credit_table(steps: pl.DataFrame, verdicts: pl.DataFrame, advantages: pl.DataFrame,
                      credit: str = "step") -> tuple[pl.DataFrame, pl.DataFrame, int]:
    """Step credit of the rollouts in ``advantages`` (rollout_id, advantage) from retained
    verdicts. Returns (step_credit, modes: rollout_id + credit_mode, citations dropped)."""
    sa = index_steps(steps, advantages, "steps")
    v = verdicts.join(advantages.select("rollout_id").with_row_index("__r"), on="rollout_id")
    p, f, dropped = citation_arrays(sa, v)
    arrays = step_credit_arrays(sa, p, f, advantages["advantage"].to_numpy().astype(np.float64),
                                credit)
    modes = advantages.select("rollout_id").with_columns(arrays["mode_r"])
    return step_credit_frame(sa, arrays), modes, dropped


def build_token_advantages(rollouts: pl.DataFrame, step_credit: pl.DataFrame,
                           rewards: pl.DataFrame, source: str = "step_credit") -> pl.DataFrame:
    """Spans-form token advantages from tables (step_credit carrying ``token_start``)."""
    sa = index_steps(step_credit, rollouts, source)
    adv = step_credit.select("rollout_id", "step", "advantage").join(
        sa.order().with_row_index("__i"), on=["rollout_id", "step"]).sort("__i")["advantage"]
    per = rollouts.select("rollout_id").join(
        rewards.select("rollout_id", "advantage", "credit_mode"), on="rollout_id", how="left",
        maintain_order="left")
    return token_spans(rollouts, sa, adv.to_numpy(), per["advantage"].fill_null(0.0).to_numpy(),
                       per["credit_mode"].fill_null("grpo_fallback").to_numpy(), source)
