"""The credit stage of ``draco run`` over chunks of whole groups, so its memory is set by the
chunk, not by the number of rollouts.

Everything credit computes depends on one group at most (SPEC §3.3–3.6): the discriminative
filter keeps a criterion by its group's verdicts, rewards and step credit are per rollout, the
group advantage standardises within the group, token spans are per rollout. So the inputs are
split by group into chunks of about ``CHUNK_ROLLOUTS`` rollouts (temporary Parquet files in
the run folder, one pass over each input), ``credit_compute`` runs on each chunk as it would on
whole files, and the chunks' rows are merged back in the order of the original rollouts into
one output set (published whole at the end, or not at all).

What only the whole tables can show is checked over the id columns first: duplicate rollout
ids, steps and verdicts of unknown rollouts, several judges, a ``retained`` column null in
part. Any of those, an input that is not a clean Parquet file, or any error a chunk raises,
sends the computation to the whole-table ``credit_compute`` on the original files: it raises
its error naming the original file, row and field exactly as before (or, where a chunk failed
for a reason of its own, computes the same tables in one piece).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from draco_cli._allocator import trim_heap
from draco_cli.credit import CreditStats, combine_stats
from draco_cli.errors import DracoError
from draco_cli.io import OutputSet
from draco_cli.ops import credit as credit_ops
from draco_cli.ops.credit import (CREDIT_ROLLOUT_COLUMNS, CREDIT_STEP_COLUMNS,
                                  CREDIT_VERDICT_COLUMNS)
from draco_cli.options import CreditOptions
from draco_cli.schemas import Step, VerdictAggregated

__all__ = ["CHUNK_ROLLOUTS", "credit_by_groups"]

# Rollouts per chunk (whole groups, so a chunk may hold one group more). Credit's working set
# is ~1.6 KB a rollout: a chunk's is a few MiB over the libraries' own. Measured on synthetic
# inputs of 20 steps a rollout (docs/run.md, Memory): credit's peak 274 -> 288 MiB from 10k to
# 100k rollouts at 4,096, 310 -> 342 at 8,192, 380 at 16,384 (100k); 2,048 saves no more and
# costs a quarter more time.
CHUNK_ROLLOUTS = 4096
OUTPUTS = ("rewards.parquet", "step_credit.parquet", "token_advantages.parquet")
WORK_PREFIX = ".draco-credit-chunks-"
_READ_ROWS = 1 << 14  # rows per batch read from an input
_MERGE_ROWS = 1 << 13
_LAYOUT_KEY = "draco.token_layout"


class _Whole(Exception):
    """The inputs need the whole-table computation (see the module's docstring)."""


def credit_by_groups(rollouts: str | Path, steps: str | Path, verdicts: str | Path | None,
                     out: str | Path, *, options: CreditOptions,
                     chunk_rollouts: int | None = None) -> tuple[CreditStats, int]:
    """``credit_compute(..., force=True)`` into ``out`` by chunks of whole groups of about
    ``chunk_rollouts`` (default ``CHUNK_ROLLOUTS``) rollouts: the same tables, row for row,
    and the same stats. Returns (stats, chunks): 1 chunk means the whole-table computation
    ran (few rollouts, or inputs only it can judge).

    The chunks' files go to a temporary folder beside ``out`` (removed at the end; one a
    killed run left is removed by the next): ``draco run`` holds its run folder's lock."""
    out = Path(out)
    chunk_rollouts = chunk_rollouts or CHUNK_ROLLOUTS
    work_root = out.parent
    for stale in work_root.glob(WORK_PREFIX + "*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    try:
        with _work_dir(work_root) as work:
            plan = _split(Path(rollouts), Path(steps),
                          None if verdicts is None else Path(verdicts), work, chunk_rollouts)
            return _compute(plan, out, options), plan.chunks
    except (_Whole, DracoError):
        pass
    return credit_ops.credit_compute(rollouts, steps, verdicts, out, options=options,
                                     force=True), 1


@contextlib.contextmanager
def _work_dir(parent: Path) -> Iterator[Path]:
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Plan:
    """The chunks' input files and what merging their outputs back needs."""

    def __init__(self, work: Path, chunk_of_row: np.ndarray, chunks: int,
                 chunk_rollouts: int) -> None:
        self.work = work
        self.chunk_rollouts = chunk_rollouts
        self.chunk_of_row = chunk_of_row      # per original rollout row
        self.chunks = chunks
        self.steps_per_rollout = np.zeros(chunk_of_row.size, dtype=np.int64)
        self.has_verdicts = False
        self.schemas: dict[str, pa.Schema] = {}

    def dir(self, k: int) -> Path:
        return self.work / f"chunk-{k:05d}"


def _parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError):
        raise _Whole from None


def _clean_ids(col: pa.ChunkedArray[Any] | pa.Array[Any]) -> bool:
    return col.null_count == 0 and (pa.types.is_string(col.type)
                                    or pa.types.is_large_string(col.type))


def _split(rollouts: Path, steps: Path, verdicts: Path | None, work: Path,
           chunk_rollouts: int) -> _Plan:
    """Chunks of whole groups, written as input files of their own; raises ``_Whole`` when the
    inputs need the whole-table computation."""
    rf = _parquet(rollouts)
    if not {"rollout_id", "group_id"} <= set(rf.schema_arrow.names):
        raise _Whole
    ids = rf.read(columns=["rollout_id", "group_id"])
    R = ids.num_rows
    if R <= chunk_rollouts:
        raise _Whole
    rid = ids.column("rollout_id").combine_chunks()
    group = ids.column("group_id").combine_chunks()
    del ids
    if not _clean_ids(rid) or group.null_count:
        raise _Whole
    if len(pc.unique(rid)) != R:  # duplicate ids: the whole-table check names them
        raise _Whole
    # groups numbered in order of first appearance; chunk k holds the groups that start in
    # [k·n, (k+1)·n) of the rollouts counted group by group (so at most n + one group)
    encoded = cast("pa.DictionaryArray[Any, Any]", pc.dictionary_encode(group))
    codes = encoded.indices.to_numpy().astype(np.int64)
    sizes = np.bincount(codes, minlength=len(encoded.dictionary))
    del group, encoded
    chunk_of_group = (np.cumsum(sizes) - sizes) // max(chunk_rollouts, 1)
    _, chunk_of_group = np.unique(chunk_of_group, return_inverse=True)
    chunks = int(chunk_of_group.max()) + 1
    if chunks < 2:
        raise _Whole
    plan = _Plan(work, chunk_of_group[codes].astype(np.int64), chunks, chunk_rollouts)
    del codes
    # the hash tables and read buffers of the id columns (tens of MiB at 100k rollouts) go
    # back to the system before the inputs are split (the draco command tells glibc to keep
    # freed blocks); so after each input
    trim_heap()
    for k in range(chunks):
        plan.dir(k).mkdir()

    def rows_of_rollouts(batch: pa.RecordBatch, start: int) -> np.ndarray:
        return np.arange(start, start + batch.num_rows, dtype=np.int64)

    def rows_by_id(batch: pa.RecordBatch, start: int) -> np.ndarray:
        if "rollout_id" not in batch.schema.names:  # the whole-table check names it
            raise _Whole
        col = batch.column("rollout_id")
        if not _clean_ids(col):
            raise _Whole
        found = pc.index_in(col.cast(rid.type), value_set=rid)
        if found.null_count:  # of an unknown rollout: the whole-table check names the row
            raise _Whole
        return found.to_numpy().astype(np.int64)

    _scatter(rf, "rollouts.parquet", CREDIT_ROLLOUT_COLUMNS, plan, rows_of_rollouts)
    steps_counted = _scatter(_parquet(steps), "steps.parquet",
                             [*Step.keys, *CREDIT_STEP_COLUMNS], plan, rows_by_id)
    plan.steps_per_rollout = steps_counted
    if verdicts is not None:
        vf = _parquet(verdicts)
        judges: set[Any] = set()
        retained_nulls = [0, 0]

        def rows_of_verdicts(batch: pa.RecordBatch, start: int) -> np.ndarray:
            names = batch.schema.names
            if "judge" in names:
                judges.update(pc.unique(batch.column("judge")).to_pylist())
                if len(judges) > 1:  # several judges: narrowed (or refused) over the whole
                    raise _Whole
            if "retained" in names:
                retained_nulls[0] += batch.column("retained").null_count
                retained_nulls[1] += batch.num_rows
            return rows_by_id(batch, start)

        _scatter(vf, "verdicts.parquet", [*VerdictAggregated.keys, *CREDIT_VERDICT_COLUMNS],
                 plan, rows_of_verdicts)
        # a retained column null in part is filled, null throughout is computed: per chunk
        # that would differ from the whole
        if 0 < retained_nulls[0] < retained_nulls[1]:
            raise _Whole
        plan.has_verdicts = True
    return plan


def _scatter(source: pq.ParquetFile, name: str, wanted: list[str], plan: _Plan,
             rows_of: Any) -> np.ndarray:
    """Append each row of ``source`` (the ``wanted`` columns it has) to its chunk's ``name``
    (an Arrow IPC stream, made Parquet when the chunk's turn comes), in file order; returns
    the number of rows per rollout.

    IPC, not Parquet: an open Parquet writer holds its encoders (~8 MiB for policy_spans), so
    one per chunk would grow with the chunks; an IPC writer holds a file handle."""
    names = source.schema_arrow.names
    columns = [c for c in dict.fromkeys(wanted) if c in names]
    schema = source.schema_arrow
    schema = pa.schema([schema.field(c) for c in columns],
                       metadata=schema.metadata)  # type: ignore[arg-type]  # as io._to_arrow
    plan.schemas[name] = schema
    per_rollout = np.zeros(plan.chunk_of_row.size, dtype=np.int64)
    writers: dict[int, Any] = {}

    def write(k: int, table: pa.Table) -> None:
        if k not in writers:
            writers[k] = pa.ipc.new_stream(str(plan.dir(k) / (name + ".arrows")), schema)
        writers[k].write_table(table)

    try:
        start = 0
        try:
            for batch in source.iter_batches(batch_size=_READ_ROWS, columns=columns):
                rows = rows_of(batch, start)
                start += batch.num_rows
                if rows.size:  # counted over the rows' span, not over every rollout
                    low = int(rows.min())
                    counts = np.bincount(rows - low)
                    per_rollout[low:low + counts.size] += counts
                chunk = plan.chunk_of_row[rows]
                table = pa.Table.from_batches([batch]).replace_schema_metadata(schema.metadata)
                if chunk.size and bool(np.all(chunk == chunk[0])):
                    write(int(chunk[0]), table)
                    continue
                for k in np.unique(chunk):
                    write(int(k), table.filter(pa.array(chunk == k)))
        except (pa.ArrowException, OSError):  # unreadable: the whole-table read says so
            raise _Whole from None
    finally:
        for w in writers.values():
            w.close()
    trim_heap()
    return per_rollout


def _chunk_input(plan: _Plan, k: int, name: str) -> Path:
    """Chunk ``k``'s ``name`` as the Parquet file ``credit_compute`` reads."""
    stream = plan.dir(k) / (name + ".arrows")
    if stream.exists():
        with pa.ipc.open_stream(pa.OSFile(str(stream), "rb")) as reader:
            table = reader.read_all()
        stream.unlink()
    else:  # no row of this input in this chunk
        table = plan.schemas[name].empty_table()
    pq.write_table(table, plan.dir(k) / name)
    return plan.dir(k) / name


def _compute(plan: _Plan, out: Path, options: CreditOptions) -> CreditStats:
    """Each chunk's credit, then the chunks' rows merged into one output set."""
    parts: list[CreditStats] = []
    for k in range(plan.chunks):
        # what the split or the last chunk freed goes back to the system first (the draco
        # command tells glibc to keep freed blocks): each chunk starts from the same floor
        trim_heap()
        d = plan.dir(k)
        parts.append(credit_ops.credit_compute(_chunk_input(plan, k, "rollouts.parquet"),
                                    _chunk_input(plan, k, "steps.parquet"),
                                    _chunk_input(plan, k, "verdicts.parquet")
                                    if plan.has_verdicts else None,
                                    d / "out", options=options, force=True))
        for name in ("rollouts.parquet", "steps.parquet", "verdicts.parquet"):
            (d / name).unlink(missing_ok=True)
    schemas = {name: _same_schema([plan.dir(k) / "out" / name for k in range(plan.chunks)])
               for name in OUTPUTS}
    per_rollout = {"rewards.parquet": np.ones(plan.chunk_of_row.size, dtype=np.int64),
                   "step_credit.parquet": plan.steps_per_rollout,
                   "token_advantages.parquet": np.ones(plan.chunk_of_row.size, dtype=np.int64)}
    with OutputSet(out, list(OUTPUTS), force=True) as output:
        for name in OUTPUTS:
            meta = dict(schemas[name].metadata or {})
            meta.update({k.encode(): v.encode() for k, v in output.metadata.items()})
            if name == "token_advantages.parquet":
                layouts = {_layout(plan.dir(k) / "out" / name) for k in range(plan.chunks)}
                meta[_LAYOUT_KEY.encode()] = (layouts.pop() if len(layouts) == 1
                                              else b"mixed")
            trim_heap()
            _merge(plan, name, schemas[name].with_metadata(meta), per_rollout[name],
                   output.path(name))
        stats = _sum_stats(parts, output.path("rewards.parquet"))
    return stats


def _same_schema(paths: list[Path]) -> pa.Schema:
    """The chunks' common schema of one output (metadata apart), or ``_Whole``."""
    first = pq.read_schema(paths[0])
    for p in paths[1:]:
        if not pq.read_schema(p).equals(first, check_metadata=False):
            raise _Whole
    return first


def _layout(path: Path) -> bytes:
    meta = pq.read_schema(path).metadata or {}
    return meta.get(_LAYOUT_KEY.encode(), b"")


class _Cursor:
    """A chunk's output file read in order, a given number of rows at a time. Opened at its
    first rows and closed after its last (``total``), and read through a small buffer: with
    inputs in group order one or two are open at a time, and none holds its file decoded."""

    def __init__(self, path: Path, total: int) -> None:
        self.path, self.left = path, total
        self.file: pq.ParquetFile | None = None
        self.batches: Iterator[pa.RecordBatch] = iter(())
        self.buffer: list[pa.RecordBatch] = []
        self.buffered = 0

    def take(self, n: int) -> list[pa.RecordBatch]:
        if n == 0:  # e.g. rollouts without steps: nothing to open (or to reopen)
            return []
        if self.file is None:
            self.file = pq.ParquetFile(self.path, pre_buffer=False, buffer_size=1 << 16)
            self.batches = self.file.iter_batches(batch_size=_MERGE_ROWS)
        while self.buffered < n:
            batch = next(self.batches, None)
            if batch is None:
                raise DracoError("internal error: a credit chunk wrote fewer rows than its "
                                 "inputs hold; nothing was written (please report this)")
            self.buffer.append(batch)
            self.buffered += batch.num_rows
        got: list[pa.RecordBatch] = []
        self.left -= n
        while n:
            head = self.buffer[0]
            if head.num_rows <= n:
                got.append(self.buffer.pop(0))
                n -= head.num_rows
                self.buffered -= head.num_rows
            else:
                got.append(head.slice(0, n))
                self.buffer[0] = head.slice(n)
                self.buffered -= n
                n = 0
        if self.left == 0:
            if self.buffered or next(self.batches, None) is not None:
                raise DracoError("internal error: a credit chunk wrote more rows than its "
                                 "inputs hold; nothing was written (please report this)")
            self.file.close()
            self.file, self.batches = None, iter(())
        return got


def _merge(plan: _Plan, name: str, schema: pa.Schema, per_rollout: np.ndarray,
           target: Path) -> None:
    """The chunks' ``name`` tables as one file with its rows in the original rollouts' order:
    block by block of original rollouts, each chunk gives its next rows (its own rollouts are
    in their original order), and a stable sort by original rollout interleaves them."""
    totals = np.bincount(plan.chunk_of_row, weights=per_rollout, minlength=plan.chunks)
    cursors = [_Cursor(plan.dir(k) / "out" / name, int(totals[k])) for k in range(plan.chunks)]
    block = max(plan.chunk_rollouts, 1)
    R = plan.chunk_of_row.size
    with pq.ParquetWriter(target, schema, compression="zstd") as writer:
        for a in range(0, R, block):
            chunk = plan.chunk_of_row[a:a + block]
            counts = per_rollout[a:a + block]
            pieces: list[pa.RecordBatch] = []
            keys = []
            for k in np.unique(chunk):
                mine = np.flatnonzero(chunk == k)
                pieces += cursors[int(k)].take(int(counts[mine].sum()))
                keys.append(np.repeat(mine, counts[mine]))
            table = pa.Table.from_batches(
                [p.replace_schema_metadata(schema.metadata) for p in pieces], schema=schema)
            if len(keys) > 1:
                table = table.take(np.argsort(np.concatenate(keys), kind="stable"))
            if table.num_rows:
                writer.write_table(table)


def _sum_stats(parts: list[CreditStats], rewards: Path) -> CreditStats:
    """The chunks' stats as the whole computation's (``combine_stats`` over the merged
    rewards file)."""
    rw = pl.read_parquet(rewards, columns=["reward", "pass_rate_all"])
    return combine_stats(parts, rw["reward"], rw["pass_rate_all"])
