"""``draco export --to rllm``: a run's per-step advantages written into rLLM's saved episodes,
each scored trajectory checked first, unscored ones ``None``; see docs/trainers.md, "rLLM"
("Offline"). ``Trajectory.from_dict`` reads ``info["draco"]`` back as metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.errors import InputError, UsageError, naming
from draco_cli.io.files import check_writable, write_text_atomic
from draco_cli.trainers.export import ExportResult, advantages_file
from draco_cli.trainers.loader import AlignmentError, load_token_advantages
from draco_cli.trainers.rllm.layout import layout_of, step_values
from draco_cli.trainers.rllm.records import read_episodes


def _fill(ep: dict[str, Any], table: Any, file: str, where: str,
          used: set[str]) -> tuple[int, int, int]:
    """Fill one episode in place; (trajectories scored, not scored, policy tokens)."""
    scored = unscored = tokens = 0
    for t, traj in enumerate(ep["trajectories"]):
        row = f"{where} trajectory {t}"
        with naming(file, row):
            layout = layout_of(traj)
        steps = traj["steps"]
        if layout.rollout_id not in table:
            unscored += 1
            for step in steps:
                step["advantage"] = None
            continue
        if layout.rollout_id in used:
            raise InputError(f"trajectory uid {layout.rollout_id!r} appears twice in the "
                             "records", file=file, row=row, field="uid")
        used.add(layout.rollout_id)
        try:
            dense = table.batch([layout.rollout_id], layout.response_mask[None, :],
                                response_ids=layout.response_ids[None, :])[0]
        except AlignmentError as exc:
            raise InputError(f"{exc} (these records are not the rollouts the advantages "
                             "were computed for)", file=file, row=row) from None
        for step, values in zip(steps, step_values(layout, np.asarray(dense))):
            step["advantage"] = values
        key = "info" if isinstance(traj.get("info"), dict) or "metadata" not in traj \
            else "metadata"
        meta = traj.get(key) if isinstance(traj.get(key), dict) else {}
        n_policy = int(layout.response_mask.sum())
        meta["draco"] = {"train_step": table.train_step(layout.rollout_id),
                         "n_policy_tokens": n_policy,
                         "response_fingerprint": layout.fingerprint,
                         "step_tokens": [e - s for s, e in layout.spans]}
        traj[key] = meta
        scored += 1
        tokens += n_policy
    return scored, unscored, tokens


def export(advantages: Path, out: Path, *, records: Path | None = None,
           force: bool = False) -> ExportResult:
    """Fill ``records`` (rLLM episodes) with the advantages of ``advantages`` (a run folder or
    token_advantages.parquet) and write them to ``out`` as JSON Lines."""
    if records is None:
        raise UsageError("--to rllm needs --records: the rLLM episodes (JSON, JSONL or a "
                         "folder of episode files) whose steps receive the advantages")
    check_writable(out, force)
    table = load_token_advantages(advantages_file(advantages))
    used: set[str] = set()
    lines: list[str] = []
    scored = unscored = tokens = 0
    for path, where, ep in read_episodes([records]):
        s, u, n = _fill(ep, table, str(path), where, used)
        scored, unscored, tokens = scored + s, unscored + u, tokens + n
        lines.append(json.dumps(ep))
    if scored == 0:
        raise InputError(f"no trajectory of these records has token advantages in "
                         f"{advantages} (matched by Trajectory.uid = draco's rollout_id)",
                         file=str(records))
    notes = []
    if unscored:
        notes.append(f"{unscored} trajectories have no draco advantages: their steps' "
                     "advantage is None (rLLM computes its own estimator for such a group, "
                     "and refuses a group that mixes them with scored ones)")
    missing = len(table) - scored
    if missing:
        notes.append(f"{missing} rollouts of the advantages file are not in these records")
    write_text_atomic(out, "".join(line + "\n" for line in lines), force=force)
    return ExportResult(out, scored, tokens, notes)
