"""Reading and writing draco tables.

- Parquet files, or ``-`` for a table on stdin (Parquet or Arrow IPC) or an Arrow IPC stream
  on stdout (never onto a terminal), so commands chain in pipes.
- Every read is checked against the table's contract (``draco_cli.schemas``) with whole-column
  operations; the first offending row of each broken rule is named with file, row and field.
- Every write is atomic (a temporary file in the destination folder, then ``os.replace``), and
  refuses to replace an existing file unless ``force`` is set.
- A command's outputs are one *output set* (``OutputSet``): written into a hidden staging
  folder under a per-folder lock, then published by renames recorded in a journal, so a set
  appears whole or not at all, and carries one id in every table's metadata.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, cast

import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from draco_cli.errors import (DracoError, InputError, OutputError, OutputExistsError, UsageError,
                              describe_os_error)
from draco_cli.schemas import Column, Table, arrow_schema, columns

STDIO = "-"


# --- atomic files -------------------------------------------------------------------------


def check_writable(path: str | os.PathLike[str], force: bool) -> None:
    """Raise before any work is done if ``path`` exists and may not be replaced."""
    if str(path) != STDIO and Path(path).exists() and not force:
        raise OutputExistsError(str(path))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    dest = Path(path)
    if dest.is_dir():
        raise UsageError(f"{dest}: is a folder, expected a file name")
    check_writable(dest, force)
    prepare_out_dir(dest.parent, "output folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as exc:
        raise OutputError(describe_os_error(exc, dest)) from None
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates the file 0600; give the output the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OutputError(describe_os_error(exc, dest)) from None
        raise


def prepare_out_dir(out: str | os.PathLike[str], option: str = "-o") -> Path:
    """Create the output folder, or say in one line why it cannot be one."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{option} {out}: is a file, expected a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        parent = next((p for p in out.parents if p.exists() and not p.is_dir()), out.parent)
        raise UsageError(f"{option} {out}: {parent} is a file, not a folder") from None
    return out


# --- output sets: a folder lock, a staging folder, a journalled publication ---------------

LOCK_FILE = ".draco-write.lock"
STAGING_PREFIX = ".draco-staging-"
JOURNAL_FILE = ".draco-publish.json"
SET_ID_KEY = "draco.output_set"
SET_MEMBERS_KEY = "draco.output_set_members"
DEFAULT_LOCK_WAIT = 30.0  # seconds a second writer waits before refusing


_HELD: set[str] = set()  # lock files this process holds


class FolderBusy(DracoError):
    """Another process holds the folder's write lock for longer than we wait."""


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike[str], wait: float | None = None) -> Iterator[None]:
    """Hold ``folder``'s write lock (an flock, released by the kernel even on kill -9).

    A second writer polls for up to ``wait`` seconds (``DRACO_LOCK_WAIT``, default 30), then
    refuses with the holder's pid."""
    if wait is None:
        wait = float(os.environ.get("DRACO_LOCK_WAIT", DEFAULT_LOCK_WAIT))
    path = Path(folder) / LOCK_FILE
    key = os.path.realpath(path)
    if key in _HELD:  # re-entrant within a process (a stage locks, then publishes its set)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise FolderBusy(
                        f"{folder} is being written by another draco command (pid {holder}); "
                        f"waited {wait:g}s; rerun when it has finished") from None
                time.sleep(0.05)
        with contextlib.suppress(OSError):  # the pid is a courtesy (a full disk refuses it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def recover_folder(folder: Path) -> bool:
    """Under the folder's lock: finish a publication a killed process left half done (its
    journal lists the renames; each is idempotent), and remove stale staging folders.
    Returns whether a publication was completed."""
    journal = folder / JOURNAL_FILE
    completed = False
    if journal.exists():
        try:
            plan = json.loads(journal.read_text())
            staging = folder / plan["staging"]
            for name in plan["files"]:
                if (staging / name).exists():
                    os.replace(staging / name, folder / name)
            completed = True
        except (ValueError, KeyError, TypeError):
            pass  # written atomically, so unreadable means not ours: nothing was renamed
        journal.unlink()
    for stale in folder.glob(STAGING_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    return completed


class OutputSet:
    """The files one command writes into one folder, published together.

    Usage: ``with OutputSet(out, ["a.parquet", "b.parquet"], force=f) as s: s.write_table(...)``.
    On entry: the folder is created and locked, an interrupted earlier publication is
    completed, existing outputs are refused without ``force``. Writes go to a hidden staging
    folder. On a clean exit the files are renamed into place (a journal makes the renames
    restartable); on an exception nothing is published and the staging folder is removed.
    ``replaceable`` names may be written over without ``force`` (e.g. rejects.jsonl).
    """

    def __init__(self, folder: str | os.PathLike[str], names: list[str], *, force: bool = False,
                 replaceable: tuple[str, ...] = (), option: str = "-o") -> None:
        self.folder = Path(folder)
        self.names = list(names) + [n for n in replaceable if n not in names]
        self.checked = list(names)
        self.force = force
        self.option = option
        self.id = uuid.uuid4().hex
        self._stack = contextlib.ExitStack()
        self.staging: Path | None = None

    @property
    def metadata(self) -> dict[str, str]:
        tables = [n for n in self.names if n.endswith(".parquet")]
        return {SET_ID_KEY: self.id, SET_MEMBERS_KEY: ",".join(tables)}

    def __enter__(self) -> OutputSet:
        self._created = not self.folder.exists()
        prepare_out_dir(self.folder, self.option)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(folder_lock(self.folder))
                recover_folder(self.folder)
                for name in self.checked:
                    check_writable(self.folder / name, self.force)
                self.staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.folder))
                self._stack = stack.pop_all()
        except OSError as exc:
            raise OutputError(describe_os_error(exc, self.folder)) from None
        return self

    def path(self, name: str) -> Path:
        if name not in self.names or self.staging is None:
            raise ValueError(f"{name} is not part of this output set")
        return self.staging / name

    def write_table(self, df: pl.DataFrame | pa.Table, name: str, model: type[Table],
                    **kwargs: Any) -> None:
        meta = {**(kwargs.pop("metadata", None) or {}), **self.metadata}
        with self._named(name):
            write_table(df, self.path(name), model, force=True, metadata=meta, **kwargs)

    def write_text(self, name: str, text: str) -> None:
        with self._named(name):
            try:
                self.path(name).write_text(text, encoding="utf-8")
            except OSError as exc:
                raise OutputError(describe_os_error(exc, self.path(name))) from None

    @contextlib.contextmanager
    def _named(self, name: str) -> Iterator[None]:
        """Errors name the output the user asked for, not its staging copy."""
        try:
            yield
        except OutputError as exc:
            raise OutputError(str(exc).replace(str(self.path(name)),
                                               str(self.folder / name))) from None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is None:
                try:
                    self._publish()
                except OSError as err:
                    raise OutputError(describe_os_error(err, self.folder)) from None
        finally:
            assert self.staging is not None
            shutil.rmtree(self.staging, ignore_errors=True)
            self._stack.close()
            if exc_type is not None and self._created:
                # A failed first write leaves no trace: not even the folder it made.
                with contextlib.suppress(OSError):
                    if os.listdir(self.folder) == [LOCK_FILE]:
                        os.unlink(self.folder / LOCK_FILE)
                        os.rmdir(self.folder)

    def _publish(self) -> None:
        assert self.staging is not None
        files = [n for n in self.names if (self.staging / n).exists()]
        journal = self.folder / JOURNAL_FILE
        write_text_atomic(journal, json.dumps({"set": self.id, "staging": self.staging.name,
                                               "files": files}), force=True)
        for name in files:
            os.replace(self.staging / name, self.folder / name)
        journal.unlink()


def write_text_atomic(path: str | os.PathLike[str], text: str, force: bool = False) -> None:
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
        refuse_binary_to_terminal()
        _write_ipc(table, sys.stdout.buffer)
        return
    with atomic_path(path, force) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _write_ipc(table: pa.Table, sink: BinaryIO) -> None:
    # pyarrow takes any binary file object; its stubs list only IOBase and NativeFile
    with ipc.new_stream(sink, table.schema) as writer:  # type: ignore[arg-type]
        writer.write_table(table)
    sink.flush()


class StreamingTableWriter:
    """Write a table batch by batch to a temporary Parquet file; commit renames it in place.

    Memory stays bounded by the batch size, whatever the input size.
    """

    def __init__(self, path: str | os.PathLike[str], model: type[Table], force: bool = False,
                 metadata: dict[str, str] | None = None):
        self.model = model
        self.schema = arrow_schema(model)
        if metadata:
            merged = dict(self.schema.metadata or {})
            merged.update({k.encode(): v.encode() for k, v in metadata.items()})
            self.schema = self.schema.with_metadata(merged)
        self._ctx = atomic_path(path, force)
        self._tmp = self._ctx.__enter__()
        self._writer = pq.ParquetWriter(self._tmp, self.schema, compression="zstd")
        self.rows = 0

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
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


class BlockWriter:
    """Tables of an ``OutputSet`` written block by block, by one background thread, while the
    caller computes the next block: Parquet's encoding and compression (most of a large
    command's write time) release the GIL, so they run on another core.

    ``write(name, table)`` hands a block over, waiting while ``depth`` blocks are pending (the
    memory in flight stays bounded); small blocks are gathered into larger row groups. Each
    file's first block sets its schema; a later block must have the same. ``close`` waits for the last block and closes the files; an error of
    the writer is raised in the caller at its next ``write`` or at ``close`` (and then nothing
    is published: the output set's body failed). Use it as a context manager inside the
    ``OutputSet``; leaving it on an error stops the thread and discards what was pending.
    """

    # Small blocks are gathered into row groups of at least this many rows (or bytes): every
    # row group starts its dictionaries and pages afresh, and 20 row groups of 50k rows cost
    # token advantages ~30% more to encode than one of 1M (measured at 1M rollouts).
    GROUP_ROWS = 1 << 19
    GROUP_BYTES = 64 << 20

    def __init__(self, output: OutputSet, depth: int = 3) -> None:
        self.output = output
        self._queue: queue.Queue[tuple[str, pa.Table] | None] = queue.Queue(maxsize=depth)
        self._writers: dict[str, pq.ParquetWriter] = {}
        self._pending: dict[str, list[pa.Table]] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="draco-block-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            name, table = item
            pending = self._pending.setdefault(name, [])
            pending.append(table)
            if (sum(t.num_rows for t in pending) >= self.GROUP_ROWS
                    or sum(t.nbytes for t in pending) >= self.GROUP_BYTES):
                self._flush(name)
        for name in list(self._pending):
            self._flush(name)

    def _flush(self, name: str) -> None:
        tables = self._pending.pop(name, [])
        if self._error is not None or not tables:
            return  # dropped until the caller sees the error
        try:
            writer = self._writers.get(name)
            if writer is None:
                writer = pq.ParquetWriter(self.output.path(name), tables[0].schema,
                                          compression="zstd")
                self._writers[name] = writer
            writer.write_table(pa.concat_tables(tables) if len(tables) > 1 else tables[0])
        except OSError as exc:
            self._error = OutputError(describe_os_error(exc, self.output.folder / name))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, name: str, table: pa.Table) -> None:
        self._raise()
        self._queue.put((name, table))

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self) -> None:
        self._stop()
        self._raise()
        for name, writer in list(self._writers.items()):
            try:
                writer.close()
            except OSError as exc:
                raise OutputError(describe_os_error(exc, self.output.folder / name)) from None
            del self._writers[name]

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        self._error = self._error or exc  # what is still queued or gathered is dropped
        self._stop()
        for writer in self._writers.values():
            with contextlib.suppress(Exception):
                writer.close()
        self._writers.clear()


# --- reading ------------------------------------------------------------------------------


def refuse_binary_to_terminal() -> None:
    """Arrow on a terminal is noise that can garble it: ``-o -`` is for pipes."""
    if sys.stdout.isatty():
        raise UsageError("-o - writes a binary Arrow stream; stdout is a terminal: pipe it into "
                         "another command (| draco validate -) or give a file name")


_stdin_table: str | None = None


def name_stdin_table(name: str | None) -> None:
    """Say which draco table the stream on stdin holds (``--table verdicts``): it is then
    checked against that contract, whatever its own metadata says."""
    global _stdin_table
    _stdin_table = name


def read_stdin_table(name: str | None = None) -> pa.Table:
    """The table piped on stdin: an Arrow IPC stream (``draco ... -o -``, polars'
    ``write_ipc_stream``), an Arrow IPC file (``write_ipc``) or a Parquet file."""
    import io

    name = name or _stdin_table
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


def _number(value: object) -> float:
    """A numeric column's min or max; 0 for an empty or all-null column."""
    return value if isinstance(value, (int, float)) else 0


def _cast_column(df: pl.DataFrame, col: Column, source: str) -> pl.DataFrame:
    target = cast(pl.Series, pl.from_arrow(pa.array([], type=col.arrow_type))).dtype
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
    if col.ge is not None and _number(df[col.name].min()) < col.ge:
        row = _first_row(df, c.is_not_null() & (c < col.ge))
        if row is not None:
            raise InputError(
                f"must be >= {col.ge:g}, got {df[col.name][row]}",
                file=source,
                row=row,
                field=col.name,
            )
    if col.le is not None and _number(df[col.name].max()) > col.le:
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
        if isinstance(low, (int, float)) and low < col.item_ge:
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
    if df.height == 0 or not keys:  # a keyless table (one row of figures) has no duplicates
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
