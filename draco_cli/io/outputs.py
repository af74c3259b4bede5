"""Output sets: a command's outputs appear together or not at all (docs/data-contracts.md)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from draco_cli.errors import (
    DracoError,
    OutputError,
    describe_os_error,
)
from draco_cli.io.files import check_writable, prepare_out_dir, write_text_atomic
from draco_cli.io.tables import contract_table, write_table
from draco_cli.schemas import Table, arrow_schema

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
def folder_lock(folder: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``folder``'s write lock; a second writer polls for up to ``DRACO_LOCK_WAIT``
    seconds, then refuses (docs/data-contracts.md, "Output sets")."""
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
    """The files one command writes into one folder, published together (docs/data-contracts.md,
    "Output sets"): ``with OutputSet(out, ["a.parquet"], force=f) as s: s.write_table(...)``.
    On an exception nothing is published. ``replaceable`` names may be written over without
    ``force`` (e.g. rejects.jsonl).
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


class TableWriter:
    """Tables of an ``OutputSet`` written part by part into its staging folder (published with
    the set), so memory stays bounded by a part. Each part is converted as ``write_table``
    converts a whole table; later parts take the first part's types. On a clean exit a table
    no part reached is written empty."""

    def __init__(self, output: OutputSet, models: dict[str, type[Table]]) -> None:
        self.output, self.models = output, models
        self._writers: dict[str, pq.ParquetWriter] = {}

    def write(self, name: str, part: pl.DataFrame | pa.Table) -> None:
        table = contract_table(part, self.models[name], metadata=self.output.metadata)
        writer = self._writers.get(name)
        if writer is None:
            writer = self._open(name, table.schema)
        # pyarrow's stubs call ``writer.schema`` a ParquetSchema: it is the Arrow schema
        elif not table.schema.equals(first := cast(pa.Schema, writer.schema),
                                     check_metadata=False):
            table = table.cast(first)
        writer.write_table(table)

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            schema = arrow_schema(self.models[name])
            self.write(name, pa.Table.from_pylist(rows, schema=schema))

    def _open(self, name: str, schema: pa.Schema) -> pq.ParquetWriter:
        writer = pq.ParquetWriter(self.output.path(name), schema, compression="zstd")
        self._writers[name] = writer
        return writer

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            for name, model in self.models.items():
                if name not in self._writers:
                    empty = arrow_schema(model).empty_table()
                    self._open(name, contract_table(empty, model,
                                                    metadata=self.output.metadata).schema)
        for writer in self._writers.values():
            if exc_type is None:
                writer.close()
            else:
                with contextlib.suppress(Exception):
                    writer.close()


class BlockWriter:
    """Tables of an ``OutputSet`` written block by block by one background thread while the
    caller computes the next (why: docs/decisions.md, "`credit compute` by blocks of whole
    groups"). ``write`` waits while ``depth`` blocks are pending; each file's first block sets
    its schema. A writer error is raised at the next ``write`` or at ``close``. Use it as a
    context manager inside the ``OutputSet``; leaving it on an error discards what is pending.
    """

    # Minimum row group, in rows or bytes (why: same section of docs/decisions.md).
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
