"""rLLM (rllm-org/rllm, read at commit 9beb6e0f): draco's per-token advantages on each
``Step.advantage``, for rLLM's ``use_precomputed_advantage`` path.

- in the loop: ``DracoGroupingHook`` (rLLM's ``traj_grouping_hook``), ``assign_advantages``
  (async, a ``StepScorer``), ``assign_advantages_blocking`` (a ``BlockingStepScorer``) and
  ``EpisodeCredit`` (one episode at a time, each group judged as it completes);
- offline: ``draco ingest rllm`` (draco_cli.ingest.rllm) and ``draco export --to rllm``
  (``export`` here).

Nothing here imports rLLM: its objects are read by their field names (``Trajectory.uid``,
``.steps``, ``.reward``; ``Step.id``, ``.prompt_ids``, ``.response_ids``, ``.advantage``).
"""

from draco_cli.trainers.rllm.export import export
from draco_cli.trainers.rllm.inloop import (DracoGroupingHook, EpisodeCredit, apply_advantages,
                                            assign_advantages, assign_advantages_blocking,
                                            check_algorithm_config, plan_groups)
from draco_cli.trainers.rllm.layout import TrajectoryLayout, layout_of, step_values

__all__ = ["DracoGroupingHook", "EpisodeCredit", "TrajectoryLayout", "apply_advantages", "assign_advantages",
           "assign_advantages_blocking", "check_algorithm_config", "export", "layout_of", "plan_groups", "step_values"]
