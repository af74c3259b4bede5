"""``draco export --to slime``: a run's token advantages as dense rows over slime's responses,
read by ``draco_cli.trainers.slime.advantages`` as it reads a run. With ``--records`` only those
samples are written, each checked first against its own tokens (docs/trainers.md, "slime")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draco_cli.errors import InputError
from draco_cli.io import atomic_path
from draco_cli.trainers.export import ExportResult
from draco_cli.trainers.loader import AlignmentError, load_token_advantages


def _records(path: Path) -> list[tuple[str, Any]]:
    from draco_cli.trainers.slime.records import dump_rollouts

    return [(f"{path}: sample {i}", r)
            for i, r in dump_rollouts(path, decode=lambda ids: "", train_step=None)
            if r is not None]


def export(advantages: Path, out: Path, *, records: Path | None = None,
           force: bool = False) -> ExportResult:
    from draco_cli.trainers.slime.hook import resolve_files

    files = [str(p) for p in resolve_files(advantages)]
    rows = _records(records) if records is not None else None
    ids = None if rows is None else [r.rollout_id for _, r in rows]
    table = load_token_advantages(files, rollout_ids=ids)
    full = pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
    checks = {c: full.column(c).to_pylist() for c in ("train_step", "n_policy_tokens",
                                                      "response_fingerprint")
              if c in full.column_names}
    where = {rid: i for i, rid in enumerate(full.column("rollout_id").to_pylist())}
    if ids is None:
        ids = list(where)
    dense: list[np.ndarray] = []
    notes: list[str] = []
    if rows is not None:
        for place, r in rows:
            if r.rollout_id not in table:
                raise InputError(f"sample index {r.rollout_id} has no advantages in "
                                 f"{advantages}", file=place.split(": sample")[0])
            mask = np.asarray(r.response_mask, dtype=np.int64)
            if table.length(r.rollout_id) != len(mask):
                raise AlignmentError(f"{place}: response of {len(mask)} tokens, the run's "
                                     f"{table.length(r.rollout_id)}: not the same response")
            got = table.batch([r.rollout_id], mask[None, :],
                              response_ids=np.asarray(r.response_ids, dtype=np.int64)[None, :],
                              train_step=r.train_step)
            dense.append(got[0])
        notes.append(f"checked against {len(rows)} samples of {records}")
    else:
        dense = [table.get(rid).astype(np.float32) for rid in ids]
        notes.append("not checked against slime samples (give --records DUMP.pt to check)")
    cols: dict[str, Any] = {
        "rollout_id": pa.array(ids, pa.string()),
        "sample_index": pa.array([int(i) if i.isdigit() else None for i in ids], pa.int64()),
        "length": pa.array([len(d) for d in dense], pa.int32()),
        "advantages": pa.array([d.tolist() for d in dense], pa.list_(pa.float32())),
    }
    types = {"train_step": pa.int32(), "n_policy_tokens": pa.int32(),
             "response_fingerprint": pa.string()}
    for name, values in checks.items():
        cols[name] = pa.array([values[where[i]] for i in ids], types[name])
    if None in cols["sample_index"].to_pylist():
        notes.append("some rollout ids are not slime sample indices (not from draco ingest "
                     "slime): sample_index is null for them")
    with atomic_path(out, force) as tmp:
        pq.write_table(pa.table(cols), tmp, compression="zstd")
    return ExportResult(path=out, rollouts=len(ids), tokens=int(sum(len(d) for d in dense)),
                        notes=notes)
