"""Reading and writing tables: Parquet files, or ``-`` for Arrow IPC on stdin and stdout."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import cast

import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from draco_cli.errors import (
    InputError,
    UsageError,
)
from draco_cli.io.checks import conform
from draco_cli.io.files import STDIO, atomic_path
from draco_cli.schemas import Table, arrow_schema, columns


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
    # pyarrow-stubs type metadata as an invariant dict[bytes | str, ...]: a schema's own
    # dict[bytes, bytes] is what pyarrow hands back and takes
    return pa.Table.from_arrays(
        arrays, schema=pa.schema(fields, metadata=schema.metadata))  # type: ignore[arg-type]


def contract_table(df: pl.DataFrame | pa.Table, model: type[Table], *,
                   drop_absent_optional: bool = False,
                   metadata: dict[str, str] | None = None) -> pa.Table:
    """The Arrow table ``write_table`` writes: contract columns in contract order and types,
    ``metadata`` added to the contract's (see ``write_table`` for ``drop_absent_optional``)."""
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
    return table


def write_table(
    df: pl.DataFrame | pa.Table,
    path: str | os.PathLike[str],
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
    table = contract_table(df, model, drop_absent_optional=drop_absent_optional,
                           metadata=metadata)
    if str(path) == STDIO:
        if sys.stdout.isatty():  # Arrow on a terminal is noise that can garble it
            raise UsageError("-o - writes a binary Arrow stream; stdout is a terminal: pipe it "
                             "into another command (| draco validate -) or give a file name")
        # pyarrow takes any binary file object; its stubs list only IOBase and NativeFile
        with ipc.new_stream(sys.stdout.buffer, table.schema) as writer:  # type: ignore[arg-type]
            writer.write_table(table)
        sys.stdout.buffer.flush()
        return
    with atomic_path(path, force) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_stdin_table(name: str | None = None) -> pa.Table:
    """The table piped on stdin: an Arrow IPC stream (``draco ... -o -``, polars'
    ``write_ipc_stream``), an Arrow IPC file (``write_ipc``) or a Parquet file. ``name`` says
    which draco table it holds (``--table verdicts``): it is then checked against that
    contract, whatever its own metadata says."""
    import io

    where = "<stdin>" if name in (None, "stdin") else f"<stdin: {name}>"
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("- reads a table from stdin, but nothing is piped in: pipe a Parquet "
                         "file or an Arrow stream, or give a file name")
    data = sys.stdin.buffer.read()
    if not data:
        raise InputError("empty input: expected a Parquet file or an Arrow IPC stream",
                         file=where)
    try:
        if data[:4] == b"PAR1":
            table = pq.read_table(pa.BufferReader(data))
        elif data[:6] == b"ARROW1":
            table = ipc.open_file(pa.BufferReader(data)).read_all()
        else:
            table = ipc.open_stream(io.BytesIO(data)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"neither Parquet nor an Arrow IPC stream ({exc})",
                         file=where) from None
    if name not in (None, "stdin"):
        meta = dict(table.schema.metadata or {})
        meta[b"draco.table"] = name.encode()
        table = table.replace_schema_metadata(meta)
    return table


def read_arrow(path: str | os.PathLike[str], columns: list[str] | None = None) -> pa.Table:
    """Read a Parquet file or (for ``-``) an Arrow IPC stream from stdin, without checks.

    ``columns`` reads only those of them the file has (the rest are left to the caller).
    """
    if str(path) == STDIO:
        table = read_stdin_table()
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
    path: str | os.PathLike[str], model: type[Table], columns: list[str] | None = None,
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
    return conform(as_frame(read_arrow(path, columns)), model, name, columns, check_keys)


def as_frame(table: pa.Table) -> pl.DataFrame:
    """An Arrow table as a polars DataFrame (``pl.from_arrow`` of a Table, typed as such)."""
    return cast(pl.DataFrame, pl.from_arrow(table))
