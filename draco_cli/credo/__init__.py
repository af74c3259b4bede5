"""CREDO (SPEC §6): rubric-predicted credit corrected by randomized execution replay.

One module per part of the method:

- ``allocation``  — where to replay: square-root allocation under a budget (Eq. 10), the
  default replay cost, the plan (Bernoulli selection with a recorded seed).
- ``protocol``    — the replay protocol: driving an external environment (JSON lines over a
  subprocess, or HTTP) through a plan, resumably, into labels and replay cost.
- ``correction``  — Δ_t from the labels and the corrected credit Ĉ_t (Eq. 6).
- ``tokens``      — corrected credit as token advantages, in the layout of ``credit compute``.
- ``heads``       — the credit and error heads: fitting, calibration, cross-fitting.
- ``evolve``      — scoring rubric edits by the held-out variance-weighted objective.
- ``propose``     — LLM-proposed rubric edits, judged, recomputed and scored.
- ``diagnostics`` — the measurements the paper asks to report (weight tails, variance split,
  allocator calibration, predictor drift, cost by category).
- ``exact_check`` — exact enumeration of a finite model against the analytic gradient.

The names below are the package's public API (kept from the single ``credo`` module).
"""

from __future__ import annotations

from draco_cli.credo.allocation import (ALLOCATIONS, DEFAULT_REPLAYS, Allocation, allocate,
                                        default_cost, plan, rollout_lengths)
from draco_cli.credo.correction import correct, deltas, rloo
from draco_cli.credo.evolve import evolve, objective
from draco_cli.credo.heads import (DRACO_FEATURES, Heads, calibration, cross_fit, draco_features,
                                   feature_columns, fit_heads, fit_with_holdout, nonneg_weighted,
                                   task_split, training_rows, weighted_ridge)

__all__ = ["ALLOCATIONS", "DEFAULT_REPLAYS", "DRACO_FEATURES", "Allocation", "Heads", "allocate",
           "calibration", "correct", "cross_fit", "default_cost", "deltas", "draco_features",
           "evolve", "feature_columns", "fit_heads", "fit_with_holdout", "nonneg_weighted",
           "objective", "plan", "rloo", "rollout_lengths", "task_split", "training_rows",
           "weighted_ridge"]
