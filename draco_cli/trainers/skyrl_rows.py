"""SkyRL records as draco reads them: a ``GeneratorOutput`` (JSON form), its trajectory ids
and outcomes, and the rows the generator delivered to the estimator. Shared by the in-loop hook
(``draco_cli.trainers.skyrl``), the ingest and the export, and importing none of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.errors import InputError
from draco_cli.trainers import field_of

REQUIRED = ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "trajectory_ids")


class Deliveries:
    """The rows ``DracoGenerator`` delivered since the estimator last ran, by group uid."""

    def __init__(self) -> None:
        self.by_uid: dict[str, list[tuple[str, np.ndarray]]] = {}

    def add(self, uid: str, rollout_id: str, values: np.ndarray) -> None:
        self.by_uid.setdefault(uid, []).append((rollout_id, values))

    def take(self) -> dict[str, list[tuple[str, np.ndarray]]]:
        out, self.by_uid = self.by_uid, {}
        return out


def trajectory(t: Any) -> tuple[str, str]:
    """(row id, group uid) of a SkyRL ``TrajectoryID`` (or its dict form in a dumped file)."""
    inst, rep = field_of(t, "instance_id"), field_of(t, "repetition_id")
    if inst is None or rep is None:
        raise InputError(f"trajectory id {t!r}: needs instance_id and repetition_id",
                         field="trajectory_ids")
    return f"{inst}_{rep}", str(inst)   # TrajectoryID.to_string()


def outcome_of(reward: Any) -> float:
    """A row's outcome as SkyRL's own estimators read it: the sum of its rewards."""
    return float(sum(reward)) if isinstance(reward, (list, tuple)) else float(reward)


def read_records(path: Path) -> dict[str, Any]:
    """One dumped ``GeneratorOutput``, its lists checked to be one entry per row."""
    if not path.is_file():
        raise InputError("no such file", file=str(path))
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"not a JSON GeneratorOutput ({exc})", file=str(path)) from None
    if not isinstance(rec, dict):
        raise InputError("expected a JSON object (a GeneratorOutput)", file=str(path))
    for key in REQUIRED:
        if not isinstance(rec.get(key), list):
            raise InputError(f"field {key!r} missing or not a list (SkyRL GeneratorOutput)",
                             file=str(path), field=key)
    n = len(rec["response_ids"])
    for key in REQUIRED:
        if len(rec[key]) != n:
            raise InputError(f"{len(rec[key])} {key} for {n} response_ids", file=str(path),
                             field=key)
    for i, (ids, m) in enumerate(zip(rec["response_ids"], rec["loss_masks"])):
        if len(ids) != len(m):
            raise InputError(f"row {i}: {len(m)} loss_masks entries for {len(ids)} response "
                             "tokens", file=str(path), field="loss_masks")
    step = rec.get("global_step")
    if step is not None and not isinstance(step, int):
        raise InputError(f"global_step {step!r} is not an integer", file=str(path),
                         field="global_step")
    return rec
