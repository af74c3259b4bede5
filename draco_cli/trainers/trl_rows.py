"""TRL's rows as draco's ``TrainerRollout``s: one per completion, grouped by prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from draco_cli.inloop import TrainerRollout


def completion_rows(completion_ids: np.ndarray, completion_mask: np.ndarray,
                    tool_mask: np.ndarray | None, pad_id: int, masked_truncated: bool
                    ) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """(response ids, policy mask, truncated) of each row of TRL's right-padded batch.

    A row's tokens are those under ``completion_mask``; its policy mask is ``completion_mask *
    tool_mask``. With ``mask_truncated_completions`` TRL zeroes a truncated row's masks: such a
    row (all-zero ``completion_mask``) is taken as its tokens up to the last non-pad one (a
    truncated completion ends in neither EOS nor pad, so that is its exact length), every one a
    policy token (its tool mask is gone with the rest)."""
    rows = []
    for b in range(completion_ids.shape[0]):
        n = int(completion_mask[b].sum())
        if n == 0 and masked_truncated:
            live = np.flatnonzero(completion_ids[b] != pad_id)
            n = int(live[-1]) + 1 if live.size else 0
            rows.append((completion_ids[b, :n], np.ones(n, dtype=np.int8), True))
            continue
        mask = completion_mask[b, :n] if tool_mask is None else \
            completion_mask[b, :n] * tool_mask[b, :n]
        rows.append((completion_ids[b, :n], mask.astype(np.int8), False))
    return rows


def group_rollouts(rows: Sequence[Mapping[str, Any]], *, group_size: int,
                   train_step: int) -> list[TrainerRollout]:
    """The step's rows in the all-process order (each a mapping with ``ids``, ``mask``,
    ``prompt``, ``outcome``, ``task_id``) as ``TrainerRollout``s: rows ``g*n .. g*n+n-1`` form
    group g, named ``step{train_step}-g{g}``, its rows ``…-{k}``."""
    from draco_cli.errors import InputError
    from draco_cli.inloop import TrainerRollout

    if len(rows) % group_size:
        raise InputError(f"train step {train_step}: {len(rows)} trainer rows do not split into "
                         f"groups of num_generations={group_size}", field="num_generations")
    out = []
    for i, r in enumerate(rows):
        gid = f"step{train_step}-g{i // group_size}"
        out.append(TrainerRollout(f"{gid}-{i % group_size}", gid, r["prompt"], r["ids"],
                                  r["mask"], outcome=r["outcome"], task_id=r["task_id"],
                                  train_step=train_step, row=i))
    return out
