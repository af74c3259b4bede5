"""Reading and writing draco tables.

- Parquet files, or ``-`` for an Arrow IPC stream on stdin/stdout, so commands chain in pipes.
- Every read is checked against the table's contract (``draco_cli.schemas``) with whole-column
  operations; the first offending row of each broken rule is named with file, row and field.
- Every write is atomic (a temporary file in the destination folder, then ``os.replace``), and
  refuses to replace an existing file unless ``force`` is set.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from draco_cli.errors import InputError, OutputExistsError
from draco_cli.schemas import Column, Table, arrow_schema, columns

STDIO = "-"


# --- atomic files -------------------------------------------------------------------------


def check_writable(path: str | os.PathLike, force: bool) -> None:
    """Raise before any work is done if ``path`` exists and may not be replaced."""
    if str(path) != STDIO and Path(path).exists() and not force:
        raise OutputExistsError(str(path))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    dest = Path(path)
    check_writable(dest, force)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates the file 0600; give the output the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, force: bool = False) -> None:
    with atomic_path(path, force) as tmp:
        tmp.write_text(text, encoding="utf-8")


# --- conforming a frame to its contract ---------------------------------------------------


def _to_arrow(df: pl.DataFrame | pa.Table, model: type[Table]) -> pa.Table:
    """Contract columns first, in contract order, cast to their Arrow types; extras after."""
    table = df.to_arrow() if isinstance(df, pl.DataFrame) else df
    schema = arrow_schema(model)
    arrays, fields = [], []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            # Strings stay as polars hands them over (large_string): Parquet stores both kinds
            # alike, and a cast would copy every string of a multi-million-row column.
            if not (pa.types.is_string(field.type) and pa.types.is_large_string(col.type)):
                col = col.cast(field.type)
            arrays.append(col)
            field = field.with_type(col.type)
        else:
            arrays.append(pa.nulls(table.num_rows, field.type))
        fields.append(field)
    for name in table.column_names:
        if name not in schema.names:
            col = table.column(name)
            # polars writes large_string / large_list; keep extras as they are.
            arrays.append(col)
            fields.append(pa.field(name, col.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))


def write_table(
    df: pl.DataFrame | pa.Table,
    path: str | os.PathLike,
    model: type[Table],
    *,
    force: bool = False,
    drop_absent_optional: bool = False,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a table atomically as Parquet, or as an Arrow IPC stream to stdout for ``-``.

    ``drop_absent_optional`` leaves out optional contract columns that the frame does not have
    (used for the two forms of token_advantages), instead of writing them as all-null.
    """
    table = _to_arrow(df, model)
    if drop_absent_optional:
        present = set(df.columns)
        keep = [c.name for c in columns(model) if c.required or c.name in present]
        keep += [n for n in table.column_names if n not in {c.name for c in columns(model)}]
        table = table.select(keep)
    if metadata:
        merged = dict(table.schema.metadata or {})
        merged.update({k.encode(): v.encode() for k, v in metadata.items()})
        table = table.replace_schema_metadata(merged)
    if str(path) == STDIO:
        _write_ipc(table, sys.stdout.buffer)
        return
    with atomic_path(path, force) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _write_ipc(table: pa.Table, sink: BinaryIO) -> None:
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    sink.flush()


class StreamingTableWriter:
    """Write a table batch by batch to a temporary Parquet file; commit renames it in place.

    Memory stays bounded by the batch size, whatever the input size.
    """

    def __init__(self, path: str | os.PathLike, model: type[Table], force: bool = False):
        self.model = model
        self.schema = arrow_schema(model)
        self._ctx = atomic_path(path, force)
        self._tmp = self._ctx.__enter__()
        self._writer = pq.ParquetWriter(self._tmp, self.schema, compression="zstd")
        self.rows = 0

    def write_rows(self, rows: list[dict]) -> None:
        if not rows:
            return
        batch = pa.Table.from_pylist(rows, schema=self.schema)
        self._writer.write_table(batch)
        self.rows += len(rows)

    def commit(self) -> None:
        self._writer.close()
        self._ctx.__exit__(None, None, None)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        err = RuntimeError("aborted")
        with contextlib.suppress(RuntimeError):
            self._ctx.__exit__(RuntimeError, err, None)


# --- reading ------------------------------------------------------------------------------


def read_arrow(path: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """Read a Parquet file or (for ``-``) an Arrow IPC stream from stdin, without checks.

    ``columns`` reads only those of them the file has (the rest are left to the caller).
    """
    if str(path) == STDIO:
        try:
            table = ipc.open_stream(sys.stdin.buffer).read_all()
        except pa.ArrowInvalid as exc:
            raise InputError(f"not an Arrow IPC stream ({exc})", file="<stdin>") from None
        return table if columns is None else table.select(
            [c for c in columns if c in table.column_names])
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", file=str(path))
    if p.is_dir():
        raise InputError("is a folder, expected a Parquet file", file=str(path))
    try:
        if columns is not None:
            names = pq.read_schema(p).names
            columns = [c for c in columns if c in names]
        return pq.read_table(p, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"not a readable Parquet file ({exc})", file=str(path)) from None


def read_table(
    path: str | os.PathLike, model: type[Table], columns: list[str] | None = None,
    check_keys: bool = True,
) -> pl.DataFrame:
    """Read a table and check it against its contract; see ``conform``.

    ``columns`` reads and checks only those contract columns (plus the table's keys), which is
    what a computation that needs few columns of a wide table should do. ``check_keys=False``
    is for callers that check a stronger property themselves (steps contiguous from 1 imply
    unique keys).
    """
    name = "<stdin>" if str(path) == STDIO else str(path)
    if columns is not None:
        columns = list(dict.fromkeys([*model.keys, *columns]))
    return conform(pl.from_arrow(read_arrow(path, columns)), model, name, columns, check_keys)


def conform(
    df: pl.DataFrame, model: type[Table], source: str, only: list[str] | None = None,
    check_keys: bool = True,
) -> pl.DataFrame:
    """Check a frame against the contract of ``model`` and cast it to the contract's types.

    Raises InputError naming ``source``, the first offending row (0-based, as DuckDB and polars
    number them) and the field. ``only`` limits the checks to those columns.
    """
    for col in columns(model):
        if only is not None and col.name not in only:
            continue
        if col.name not in df.columns:
            if col.required:
                raise InputError(
                    f"missing required column of table '{model.table_name}'",
                    file=source,
                    field=col.name,
                )
            df = df.with_columns(pl.lit(None).alias(col.name))
        df = _cast_column(df, col, source)
        _check_column(df, col, source)
    if check_keys:
        _check_unique(df, model, source)
    return df


def _cast_column(df: pl.DataFrame, col: Column, source: str) -> pl.DataFrame:
    target = pl.from_arrow(pa.array([], type=col.arrow_type)).dtype
    if df.schema[col.name] == target:
        return df
    try:
        return df.with_columns(pl.col(col.name).cast(target, strict=True))
    except Exception:  # polars raises several exception types for failed casts
        bad = df.with_row_index("__row").filter(
            pl.col(col.name).cast(target, strict=False).is_null() & pl.col(col.name).is_not_null()
        )
        row = int(bad["__row"][0]) if bad.height else None
        value = bad[col.name][0] if bad.height else None
        raise InputError(
            f"expected {col.arrow_type}, got {df.schema[col.name]}"
            + (f" (value {value!r})" if value is not None else ""),
            file=source,
            row=row,
            field=col.name,
        ) from None


def _first_row(df: pl.DataFrame, mask: pl.Expr) -> int | None:
    hit = df.select(mask.arg_true().first()).item()
    return None if hit is None else int(hit)


def _check_column(df: pl.DataFrame, col: Column, source: str) -> None:
    c = pl.col(col.name)
    # Cheap whole-column tests first; the offending row is looked for only on failure.
    if not col.nullable and df[col.name].null_count():
        row = _first_row(df, c.is_null())
        raise InputError("must not be null", file=source, row=row, field=col.name)
    if col.choices is not None:
        row = _first_row(df, c.is_not_null() & ~c.is_in(list(col.choices)))
        if row is not None:
            raise InputError(
                f"{df[col.name][row]!r} is not one of {', '.join(col.choices)}",
                file=source,
                row=row,
                field=col.name,
            )
    if col.ge is not None and (df[col.name].min() or 0) < col.ge:
        row = _first_row(df, c.is_not_null() & (c < col.ge))
        if row is not None:
            raise InputError(
                f"must be >= {col.ge:g}, got {df[col.name][row]}",
                file=source,
                row=row,
                field=col.name,
            )
    if col.le is not None and (df[col.name].max() or 0) > col.le:
        row = _first_row(df, c.is_not_null() & (c > col.le))
        if row is not None:
            raise InputError(
                f"implausible value {df[col.name][row]} (more than {col.le:.0f}); "
                "refusing it before allocating anything for it",
                file=source,
                row=row,
                field=col.name,
            )
    is_list = isinstance(df.schema[col.name], pl.List)
    if col.item_ge is not None and is_list and df.height:
        low = df[col.name].list.min().min()
        if low is not None and low < col.item_ge:
            row = _first_row(df, c.list.min() < col.item_ge)
            assert row is not None
            raise InputError(
                f"every element must be >= {col.item_ge:g}, got {df[col.name][row].to_list()}",
                file=source, row=row, field=col.name,
            )
    if col.finite:
        row = first_non_finite(df, col.name)
        if row is not None:
            value = df[col.name][row]
            if is_list:
                value = next(x for x in value.to_list() if x is not None and not math.isfinite(x))
            raise InputError(f"must be a finite number, got {value}", file=source, row=row,
                             field=col.name)


def first_non_finite(df: pl.DataFrame, name: str) -> int | None:
    """Row of the first NaN or ±inf in a float (or list-of-float) column; None if all finite.

    One whole-column pass; nulls are not this check's business (nullability is)."""
    s = df[name]
    if isinstance(s.dtype, pl.List):
        flat = s.explode()
        if not flat.dtype.is_float() or flat.is_finite().fill_null(True).all():
            return None
        return _first_row(df, pl.col(name).list.eval(~pl.element().is_finite()).list.any())
    if not s.dtype.is_float() or s.is_finite().fill_null(True).all():
        return None
    return _first_row(df, ~pl.col(name).is_finite())


def require_finite(df: pl.DataFrame, names: list[str] | tuple[str, ...], source: str) -> None:
    """Raise InputError at the first NaN or ±inf in any of ``names`` (columns it has)."""
    for name in names:
        if name in df.columns:
            row = first_non_finite(df, name)
            if row is not None:
                raise InputError(f"must be a finite number, got {df[name][row]}", file=source,
                                 row=row, field=name)


def _check_unique(df: pl.DataFrame, model: type[Table], source: str) -> None:
    keys = list(model.keys)
    if df.height == 0:
        return
    # Fast path: distinct hashes mean distinct keys (a collision only costs the exact check).
    if df.select(pl.struct(keys).hash().n_unique()).item() == df.height:
        return
    # Name the repeat, not the first occurrence: that is the row a user must look at.
    dup = df.select((~pl.struct(keys).is_first_distinct()).arg_true().first()).item()
    if dup is not None:
        row = int(dup)
        key = ", ".join(f"{k}={df[k][row]!r}" for k in keys)
        raise InputError(
            f"duplicate key ({key}) of table '{model.table_name}'",
            file=source,
            row=row,
            field=keys[-1] if len(keys) == 1 else "(" + ", ".join(keys) + ")",
        )
