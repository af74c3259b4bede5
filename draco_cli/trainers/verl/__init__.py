"""verl (0.9): draco's token advantages through verl's own data path.

- In the loop (``hook``): agent-loop managers whose workers send each finished session to the
  job's one shared scorer (``scorer``, a named async Ray actor hosting a StepScorer) and put
  its advantages in the row's ``extra_fields``; the ``draco`` estimator reads them from the row.
- From files (``estimator``): per-row ids, checked against ``token_advantages.parquet``.

``setup`` (Ray's ``worker_process_setup_hook``) registers the estimator in every process. This
package imports neither verl, Ray nor torch until used (``hook`` imports verl and Ray).
"""

from draco_cli.trainers.verl.estimator import (
    ADV_FIELD,
    ENV_FILES,
    ESTIMATOR,
    GROUP_FIELD,
    ROW_ID_FIELD,
    SOURCE_FIELD,
    STEP_FIELD,
    Rows,
    draco_advantages,
    registered,
    rollout_id,
    row_ids_from_keys,
    setup,
)
from draco_cli.trainers.verl.scorer import ACTOR_NAME, ENV_SETTINGS

__all__ = ["ACTOR_NAME", "ADV_FIELD", "ENV_FILES", "ENV_SETTINGS", "ESTIMATOR", "GROUP_FIELD",
           "ROW_ID_FIELD", "SOURCE_FIELD", "STEP_FIELD", "Rows", "draco_advantages",
           "registered", "rollout_id", "row_ids_from_keys", "setup"]
