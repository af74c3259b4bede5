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
from draco_cli.credit.core import (CreditResult, CreditStats, compute_credit,
                                   discriminative_filter, group_advantage, rewards_table,
                                   step_credit_table)
from draco_cli.credit.inputs import StepArrays, attach_groups, index_steps, narrow_judge
from draco_cli.credit.tokens import (build_token_advantages, dense_to_spans, form_of,
                                     spans_to_dense, token_spans)

__all__ = ["CreditResult", "CreditStats", "StepArrays", "attach_groups",
           "build_token_advantages", "compute_credit", "credit_compute", "credit_expand",
           "dense_to_spans", "discriminative_filter", "form_of", "group_advantage",
           "index_steps", "narrow_judge", "rewards_table", "spans_to_dense",
           "step_credit_table", "token_spans"]
