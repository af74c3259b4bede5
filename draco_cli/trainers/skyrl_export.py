"""``draco export --to skyrl``: a run's token advantages written as the ``rewards`` of SkyRL
generator records, each row checked first; ``load_export`` reads the file back checked, with
the ``Deliveries`` the estimator needs. See docs/trainers.md, "SkyRL" ("Offline")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.errors import InputError, UsageError
from draco_cli.trainers.export import ExportResult, advantages_file
from draco_cli.trainers.skyrl_rows import Deliveries, read_records, trajectory

__all__ = ["dump_records", "export", "export_records", "load_export"]


def _jsonable(output: Any) -> dict[str, Any]:
    out = {}
    for key, value in dict(output).items():
        if key == "trajectory_ids" and value is not None:
            value = [{"instance_id": t.instance_id, "repetition_id": t.repetition_id}
                     if not isinstance(t, dict) else t for t in value]
        if key in ("rollout_metrics", "pixel_values", "image_grid_thw",
                   "rollout_expert_indices"):
            continue   # not per-token text data; tensors do not go to JSON
        out[key] = value
    return out


def dump_records(output: Any, path: str | Path, *, global_step: int | None = None) -> Path:
    """Write a SkyRL ``GeneratorOutput`` as the JSON record ``draco ingest skyrl`` reads.
    ``trajectory_ids`` are needed (the generator input's, if the output lacks them)."""
    from draco_cli.io.files import write_text_atomic

    rec = _jsonable(output)
    if global_step is not None:
        rec["global_step"] = int(global_step)
    dest = Path(path)
    write_text_atomic(dest, json.dumps(rec), force=True)
    return dest


def export_records(advantages: Path, out: Path, *, records: Path | None,
                   force: bool = False) -> ExportResult:
    from draco_cli.io.files import write_text_atomic
    from draco_cli.trainers.loader import AlignmentError, fingerprint, load_token_advantages

    if records is None:
        raise UsageError("--to skyrl needs --records FILE: the SkyRL generator output "
                         "(JSON) whose rows receive the advantages")
    rec = read_records(records)
    source = advantages_file(advantages)
    table = load_token_advantages(source)
    ids = [trajectory(t)[0] for t in rec["trajectory_ids"]]
    lengths = [len(r) for r in rec["response_ids"]]
    T = max(lengths, default=0)
    mask = np.zeros((len(ids), T), dtype=np.int64)
    tokens = np.zeros((len(ids), T), dtype=np.int64)
    for b, (r, m) in enumerate(zip(rec["response_ids"], rec["loss_masks"])):
        tokens[b, :len(r)] = r
        mask[b, :len(m)] = m
    step = rec.get("global_step")
    try:
        values = table.batch(ids, mask, response_ids=tokens,
                             train_step=None if step is None else int(step))
    except AlignmentError as exc:
        raise InputError(f"{exc} (--advantages {advantages})", file=str(records),
                         field="rewards") from None
    rec["rewards"] = [values[b, :n].tolist() for b, n in enumerate(lengths)]
    rec["draco"] = {"source": str(source), "rollout_ids": ids,
                    "train_step": step,
                    "n_policy_tokens": [int(m.sum()) for m in mask],
                    "response_fingerprints": [fingerprint(r) for r in rec["response_ids"]]}
    write_text_atomic(out, json.dumps(rec), force)
    return ExportResult(out, len(ids), int(sum(lengths)),
                        notes=["rewards are draco's per-token values: train with "
                               "trainer.algorithm.advantage_estimator=draco "
                               "(draco_cli.trainers.skyrl.register_estimator)"])


def load_export(path: str | Path) -> tuple[dict[str, Any], Any]:
    """An exported file back as (GeneratorOutput dict, ``Deliveries`` for the estimator),
    each row re-checked against its self-check (id, mask count, fingerprint)."""
    from draco_cli.trainers.loader import fingerprint

    p = Path(path)
    rec = read_records(p)
    check = rec.get("draco")
    if not isinstance(check, dict):
        raise InputError("no 'draco' self-check: not a draco export", file=str(p), field="draco")
    deliveries = Deliveries()
    for b, t in enumerate(rec["trajectory_ids"]):
        rid, uid = trajectory(t)
        ids, m, v = rec["response_ids"][b], rec["loss_masks"][b], rec["rewards"][b]
        if (rid != check["rollout_ids"][b] or sum(m) != check["n_policy_tokens"][b]
                or fingerprint(ids) != check["response_fingerprints"][b]):
            raise InputError(f"row {b} ({rid!r}) no longer matches its self-check",
                             file=str(p), field="draco")
        if not isinstance(v, list) or len(v) != len(ids):
            raise InputError(f"row {b} ({rid!r}): rewards are not one value per response "
                             "token", file=str(p), field="rewards")
        deliveries.add(uid, rid, np.asarray(v, dtype=np.float32))
    return rec, deliveries


# what ``draco export --to skyrl`` calls (draco_cli.trainers.export.STACKS)
export = export_records
