"""A trainer's finished rollout → draco's ``rollouts`` and ``steps`` rows.

A trainer holds a rollout as its response token ids and a mask (1 = a token the policy
generated, 0 = a tool result, a user turn, a chat-template header). The steps are the runs of
policy tokens, in order; a step's text is its tokens decoded and its observation the
non-policy tokens that follow it, decoded. Positions (``token_start``, ``policy_spans``) and the
fingerprint come from those same ids, so the advantages land on the trainer's own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from draco_cli.errors import InputError
from draco_cli.schemas import Step, polars_schema

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class TrainerRollout:
    """One finished rollout as the trainer holds it.

    ``rollout_id`` is unique within the step; ``group_id`` names its GRPO group (rollouts of
    one prompt sampled together); ``instruction`` is the task text (the prompt, decoded);
    ``outcome`` the environment's reward (1 = success), None where there is none; ``row`` the
    trainer's row index, named in errors."""

    rollout_id: str
    group_id: str
    instruction: str
    response_ids: Sequence[int] | np.ndarray
    response_mask: Sequence[int] | np.ndarray
    outcome: float | None = None
    task_id: str | None = None
    train_step: int | None = None
    row: int | None = None

    def where(self) -> str:
        row = f"trainer row {self.row} " if self.row is not None else ""
        return f"{row}(rollout {self.rollout_id!r}, group {self.group_id!r})"


def policy_runs(mask: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Half-open [start, end) runs of 1s in a 0/1 mask."""
    m = np.concatenate(([0], (np.asarray(mask) != 0).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(m))
    return edges[0::2], edges[1::2]


def checked_arrays(r: TrainerRollout) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a rollout as int64 arrays, or an error naming its trainer row."""
    ids = np.asarray(r.response_ids)
    mask = np.asarray(r.response_mask)
    if ids.ndim != 1 or mask.ndim != 1:
        raise InputError(f"{r.where()}: response_ids and response_mask must be 1-D, got "
                         f"shapes {ids.shape} and {mask.shape}", field="response_mask")
    if len(ids) != len(mask):
        raise InputError(f"{r.where()}: response_mask has {len(mask)} entries but "
                         f"response_ids {len(ids)}: they must describe the same tokens",
                         field="response_mask")
    if len(mask) and not np.isin(mask, (0, 1)).all():
        raise InputError(f"{r.where()}: response_mask holds values other than 0 and 1",
                         field="response_mask")
    if not mask.any():
        raise InputError(f"{r.where()}: no policy tokens (response_mask is all 0): nothing to "
                         "credit", field="response_mask")
    if r.outcome is not None and not np.isfinite(r.outcome):
        raise InputError(f"{r.where()}: outcome {r.outcome!r} is not a finite number",
                         field="outcome")
    return ids.astype(np.int64, copy=False), mask.astype(np.int8, copy=False)


def trainer_rows(rollouts: Sequence[TrainerRollout], decode: Decode
                 ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(rollouts, steps) tables of SPEC §2 for the trainer's rollouts (checked, see
    ``checked_arrays``); ``decode`` turns token ids into text (the tokenizer's ``decode``)."""
    return row_frames([rollout_records(r, decode) for r in rollouts])


Records = tuple[dict[str, Any], list[dict[str, Any]]]


def rollout_records(r: TrainerRollout, decode: Decode) -> Records:
    """One rollout's row and step rows (checked, decoded): ``trainer_rows`` of one rollout,
    before the tables are made."""
    from draco_cli.trainers.loader import fingerprint

    ids, mask = checked_arrays(r)
    start, end = policy_runs(mask)
    obs_end = np.append(start[1:], len(ids))
    steps = [{"rollout_id": r.rollout_id, "step": j + 1, "action": decode(ids[s:e].tolist()),
              "observation": decode(ids[e:oe].tolist()) if oe > e else "",
              "n_tokens": e - s, "token_start": s}
             for j, (s, e, oe) in enumerate(zip(start.tolist(), end.tolist(), obs_end.tolist()))]
    return {"rollout_id": r.rollout_id, "group_id": r.group_id,
            "task_id": r.task_id if r.task_id is not None else r.group_id,
            "train_step": r.train_step, "instruction": r.instruction,
            "outcome": None if r.outcome is None else float(r.outcome),
            "n_turns": len(start), "response_len": len(ids),
            "policy_spans": [[s, e] for s, e in zip(start.tolist(), end.tolist())],
            "response_fingerprint": fingerprint(ids)}, steps


def row_frames(records: Sequence[Records]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The (rollouts, steps) tables of rollouts' records."""
    rows = [row for row, _ in records]
    steps = [s for _, rollout_steps in records for s in rollout_steps]
    schema: dict[str, pl.DataType | type[pl.DataType]] = {"rollout_id": pl.String, "group_id": pl.String, "task_id": pl.String,
              "train_step": pl.Int32, "instruction": pl.String, "outcome": pl.Float64,
              "n_turns": pl.Int32, "response_len": pl.Int32,
              "policy_spans": pl.List(pl.List(pl.Int32)), "response_fingerprint": pl.String}
    step_schema = polars_schema(Step)
    return (pl.DataFrame(rows, schema=schema) if rows else pl.DataFrame(schema=schema),
            pl.DataFrame(steps, schema=step_schema) if steps else pl.DataFrame(schema=step_schema))
