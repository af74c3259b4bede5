"""Reading step labels for the step-label audit (the two formats: docs/audits.md). A results
file's line is keyed by ``record_id`` or by ``data_source``/``query_index``/``sample_index``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl

from draco_cli.errors import InputError
from draco_cli.ingest.agentprocessbench import LABELS, label_value

COLUMNS = {"rollout_id": pl.String, "step": pl.Int64, "label": pl.Int64, "labeler": pl.String,
           "reason": pl.String, "row": pl.String, "file": pl.String}


def split_spec(spec: str) -> tuple[str | None, Path]:
    """``NAME=PATH`` or ``PATH``: (labeler name or None, path). A path holding '=' and
    existing as given is a path."""
    if "=" in spec and not Path(spec).exists():
        name, _, path = spec.partition("=")
        if name:
            return name, Path(path)
    return None, Path(spec)


def is_parquet(path: Path) -> bool:
    with path.open("rb") as fp:
        return fp.read(4) == b"PAR1"


def read_labels(spec: str, message_steps: dict[tuple[str, int], int]) -> pl.DataFrame:
    """The labels of one ``--labels`` value with their row names (``row``, ``file``);
    ``message_steps`` maps (rollout_id, message index) to draco's step, for files keyed by
    message index."""
    name, path = split_spec(spec)
    if not path.is_file():
        raise InputError("no such file", file=str(path))
    if is_parquet(path):
        return _table(path, name)
    return _results_file(path, name, message_steps)


def _table(path: Path, name: str | None) -> pl.DataFrame:
    df = pl.read_parquet(path)
    for col in ("rollout_id", "step", "label") + (() if name else ("labeler",)):
        if col not in df.columns:
            raise InputError("missing column: a step_labels table has rollout_id, step, "
                             "label, labeler", file=str(path), field=col)
    for col in ("step", "label"):
        if not df[col].dtype.is_integer():
            raise InputError(f"expected integers, got {df[col].dtype}", file=str(path),
                             field=col)
    out = df.select(
        pl.col("rollout_id").cast(pl.String), pl.col("step").cast(pl.Int64),
        pl.col("label").cast(pl.Int64),
        (pl.lit(name) if name else pl.col("labeler")).cast(pl.String).alias("labeler"),
        (pl.col("reason") if "reason" in df.columns else pl.lit(None)).cast(pl.String)
        .alias("reason"),
    ).with_row_index("i").with_columns(
        pl.format("row {}", pl.col("i") + 1).alias("row"), pl.lit(str(path)).alias("file"))
    return out.drop("i")


def _record_id(raw: dict[str, Any]) -> str | None:
    if isinstance(raw.get("record_id"), str):
        return str(raw["record_id"])
    if all(k in raw for k in ("data_source", "query_index", "sample_index")):
        return f"{raw['data_source']}:{raw['query_index']}:{raw['sample_index']}"
    return None


def _results_file(path: Path, name: str | None, message_steps: dict[tuple[str, int], int]
                  ) -> pl.DataFrame:
    rows: list[dict[str, Any]] = []
    file = str(path)
    with path.open(encoding="utf-8") as fp:
        for lineno, line in enumerate(fp, start=1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"neither a step_labels Parquet table nor a JSON-lines "
                                 f"results file ({exc.msg})", file=file, row=where) from None
            if not isinstance(raw, dict) or not isinstance(raw.get("step_labels"), dict):
                raise InputError("a results line is an object with step_labels keyed by "
                                 "message index", file=file, row=where, field="step_labels")
            rid = _record_id(raw)
            if rid is None:
                raise InputError("missing: record_id (or data_source, query_index and "
                                 "sample_index)", file=file, row=where, field="record_id")
            labeler = name or raw.get("annotator") or path.stem
            why = ((raw.get("explanations") or {}).get("steps") or {}) \
                if isinstance(raw.get("explanations"), dict) else {}
            for key, value in raw["step_labels"].items():
                field = f"step_labels[{key!r}]"
                label = label_value(value)
                if label is None:
                    raise InputError(f"label {value!r} is not one of -1, 0, 1", file=file,
                                     row=where, field=field)
                try:
                    index = int(key)
                except ValueError:
                    raise InputError(f"key {key!r} is not a message index", file=file,
                                     row=where, field=field) from None
                step = message_steps.get((rid, index))
                if step is None:
                    known = any(r == rid for r, _ in message_steps)
                    what = (f"message {index} of rollout {rid!r} is not a labelled step"
                            if known else f"unknown rollout {rid!r} (no labelled steps)")
                    raise InputError(f"{what}: the message-index map comes from the "
                                     "step_labels table draco ingest wrote", file=file,
                                     row=where, field=field)
                reason = why.get(key) if isinstance(why, dict) else None
                rows.append({"rollout_id": rid, "step": step, "label": label,
                             "labeler": str(labeler),
                             "reason": reason if isinstance(reason, str) else None,
                             "row": where, "file": file})
    return pl.DataFrame(rows, schema=COLUMNS)


def message_steps(labels: pl.DataFrame) -> dict[tuple[str, int], int]:
    """(rollout_id, message index) -> step, from a step_labels table with message_index."""
    if "message_index" not in labels.columns:
        return {}
    m = labels.filter(pl.col("message_index").is_not_null())
    return {(r, int(i)): int(s) for r, i, s in
            m.select("rollout_id", "message_index", "step").unique().iter_rows()}


def check_labels(labels: pl.DataFrame, n_steps: dict[str, int]) -> pl.DataFrame:
    """Refuse labels on unknown rollouts or steps the rollout does not have, labels outside
    {−1, 0, 1}, and two labels for one step from one labeler; the first bad row is named."""
    def first(bad: pl.DataFrame, message: str, field: str) -> None:
        if bad.height:
            row = bad.row(0, named=True)
            raise InputError(message.format(**row), file=row["file"], row=row["row"],
                             field=field)

    known = pl.DataFrame({"rollout_id": list(n_steps), "_m": list(n_steps.values())},
                         schema={"rollout_id": pl.String, "_m": pl.Int64})
    x = labels.join(known, on="rollout_id", how="left")
    first(x.filter(pl.col("_m").is_null()), "unknown rollout {rollout_id!r} (not in the "
          "rollouts audited)", "rollout_id")
    first(x.filter((pl.col("step") < 1) | (pl.col("step") > pl.col("_m"))),
          "step {step} of rollout {rollout_id!r}, which has {_m} steps", "step")
    first(x.filter(~pl.col("label").is_in(list(LABELS))), "label {label} is not one of "
          "-1, 0, 1", "label")
    dup = x.filter(pl.struct("rollout_id", "step", "labeler").is_duplicated())
    if dup.height:
        a = dup.row(0, named=True)
        b = dup.filter((pl.col("rollout_id") == a["rollout_id"]) & (pl.col("step") == a["step"])
                       & (pl.col("labeler") == a["labeler"])).row(1, named=True)
        raise InputError(f"second label from {a['labeler']!r} for step {a['step']} of "
                         f"rollout {a['rollout_id']!r} (first at {a['file']} {a['row']})",
                         file=b["file"], row=b["row"], field="step")
    return labels
