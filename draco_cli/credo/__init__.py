"""CREDO (SPEC §6): rubric-predicted credit corrected by randomized execution replay.

One module per part of the method; see docs/credo.md, "Code layout". The names below are the
package's public API (kept from the single ``credo`` module).
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
