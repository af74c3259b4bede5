"""rLLM (read at commit 9beb6e0f): draco's per-token advantages on each ``Step.advantage``. In
the loop: ``DracoGroupingHook``, ``assign_advantages(_blocking)``, ``EpisodeCredit``; offline:
``export``. See docs/trainers.md, "rLLM". Nothing here imports rLLM: its objects are read by
field name."""

from draco_cli.trainers.rllm.export import export
from draco_cli.trainers.rllm.inloop import (DracoGroupingHook, EpisodeCredit, apply_advantages,
                                            assign_advantages, assign_advantages_blocking,
                                            check_algorithm_config, plan_groups)
from draco_cli.trainers.rllm.layout import TrajectoryLayout, layout_of, step_values

__all__ = ["DracoGroupingHook", "EpisodeCredit", "TrajectoryLayout", "apply_advantages", "assign_advantages",
           "assign_advantages_blocking", "check_algorithm_config", "export", "layout_of", "plan_groups", "step_values"]
