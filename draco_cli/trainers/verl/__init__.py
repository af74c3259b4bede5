"""verl (0.9): draco's token advantages through verl's own data path, in the loop (``hook``,
``scorer``) or from files (``estimator``); ``setup`` registers the estimator in every process.
See docs/trainers.md, "verl (0.9)". Imports neither verl, Ray nor torch until used (``hook``
imports verl and Ray)."""

from draco_cli.trainers.verl.estimator import (
    ENV_FILES,
    ESTIMATOR,
    ROW_ID_FIELD,
    STEP_FIELD,
    rollout_id,
    row_ids_from_keys,
    setup,
)
from draco_cli.trainers.verl.scorer import ENV_SETTINGS

__all__ = ["ENV_FILES", "ENV_SETTINGS", "ESTIMATOR", "ROW_ID_FIELD", "STEP_FIELD", "rollout_id",
           "row_ids_from_keys", "setup"]
