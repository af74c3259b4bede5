"""Credit (SPEC §3.3–3.6): rollouts, steps and judge verdicts → rewards, group advantages,
step credit conserving each rollout's total, and per-token advantages for the trainer.

- ``core``: the discriminative filter, rewards, group advantages, step credit
  (``compute_credit`` chains them over in-memory tables);
- ``inputs``: steps and verdicts as arrays indexed by rollout, and their checks;
- ``tokens``: token advantages (spans and dense forms, exactly convertible);
- ``tables``: the input tables as ``credit compute`` reads and checks them;
- ``compute``: ``credit_compute`` (files in, one output set out) and ``credit_expand``;
- ``blocks``: its out-of-core path, block by block of whole groups.
"""

from draco_cli.credit.compute import credit_compute, credit_expand
from draco_cli.credit.core import (CreditStats, compute_credit, discriminative_filter,
                                   group_advantage, rewards_table)
from draco_cli.credit.inputs import attach_groups, index_steps, narrow_judge

__all__ = ["CreditStats", "attach_groups", "compute_credit", "credit_compute", "credit_expand",
           "discriminative_filter", "group_advantage", "index_steps", "narrow_judge",
           "rewards_table"]
