"""How validation problems are collected and reported: each names file, row and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from draco_cli.errors import InputError
from draco_cli.schemas import TABLES, Table

MAX_PER_RULE = 5  # rows listed per broken rule; the count says how many in all


def detect_table(path: str | Path, metadata: dict[bytes, bytes] | None) -> type[Table] | None:
    """The table a file holds: from the metadata draco writes, else from the file name."""
    name = (metadata or {}).get(b"draco.table")
    if name is not None and name.decode() in TABLES:
        return TABLES[name.decode()]
    stem = Path(path).name.split(".")[0]
    return TABLES.get(stem)


def _rows(df: pl.DataFrame, mask: pl.Expr) -> tuple[list[int], int]:
    idx = df.select(mask.arg_true()).to_series()
    return idx.head(MAX_PER_RULE).to_list(), idx.len()


def _report(source: str, field: str, what: str, rows: list[int], n: int) -> list[str]:
    if not n:
        return []
    listed = ", ".join(str(r) for r in rows) + (f" and {n - len(rows)} more" if n > len(rows)
                                                else "")
    return [f"{source}: row {listed}: field '{field}': {what}"]


Issue = tuple[list[int], int, str]


def _issue(rows: np.ndarray, what: str) -> list[Issue]:
    rows = np.unique(rows)
    return [(rows[:MAX_PER_RULE].tolist(), int(rows.size), what)] if rows.size else []


def _combined(arr: pa.Array[Any] | pa.ChunkedArray[Any]) -> pa.Array[Any]:
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def raise_first(issues: list[Issue], source: str, field: str) -> None:
    """Raise the first issue as an InputError (how commands use the shared checks)."""
    if issues:
        rows, n, what = issues[0]
        more = f" ({n} rows)" if n > 1 else ""
        raise InputError(what + more, file=source, row=rows[0] if rows else None, field=field)
