"""Trainer side: token advantages as dense numpy arrays aligned with a trainer's response tokens,
each row matched by the id it carries and checked (``AlignmentError``). Needs numpy and pyarrow
only, so it imports cheaply inside a training worker. See docs/trainers.md, "The file checks
itself"."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["AdvantageFiles", "AlignmentError", "TokenAdvantageTable", "load_token_advantages",
           "fingerprint", "group_rollout_ids"]

# Spans of many rollouts: (offsets per rollout, start, end, value), each a flat array.
_Spans = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def fingerprint(token_ids: Sequence[int] | np.ndarray) -> str:
    """Hash of a response's token ids (16 hex digits), as recorded in ``response_fingerprint``.

    Two rollouts of equal length and equal mask differ here as soon as one token differs, which
    is what catches rows swapped under equal masks."""
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64).astype("<i8", copy=False))
    return hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()


class AlignmentError(ValueError):
    """The advantages do not fit the trainer's tokens (wrong ids, lengths or mask)."""


class TokenAdvantageTable:
    """Token advantages of many rollouts, by rollout id (spans or dense form)."""

    def __init__(self, table: pa.Table, source: str = "token_advantages") -> None:
        self.source = source
        ids = table.column("rollout_id").to_pylist()
        self._row = {rid: i for i, rid in enumerate(ids)}
        if len(self._row) != len(ids):
            raise AlignmentError(f"{source}: duplicate rollout_id")
        self._length = table.column("length").to_numpy().astype(np.int64)
        self._dense: tuple[np.ndarray, np.ndarray] | None = None  # offsets, values
        self._spans: _Spans | None = None
        names = table.column_names
        if "advantages" in names and table.column("advantages").null_count < table.num_rows:
            col = _list_column(table, "advantages")
            self._dense = (col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False)
                           .astype(np.float32))
        elif "span_start" in names:
            cols = [_list_column(table, c) for c in ("span_start", "span_end", "span_value")]
            start, end, value = (c.values.to_numpy(zero_copy_only=False) for c in cols)
            self._spans = (cols[0].offsets.to_numpy(), start, end, value)
        else:
            raise AlignmentError(f"{source}: neither 'advantages' nor span columns")
        self._train_step = _optional_column(table, "train_step", pa.int64())
        self._n_policy = _optional_column(table, "n_policy_tokens", pa.int64())
        fp: list[str | None] = (table.column("response_fingerprint").to_pylist()
              if "response_fingerprint" in names else [None] * table.num_rows)
        self._fingerprint = fp

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._row

    def length(self, rollout_id: str) -> int:
        return int(self._length[self._index(rollout_id)])

    def _index(self, rollout_id: str) -> int:
        try:
            return self._row[rollout_id]
        except KeyError:
            raise AlignmentError(f"{self.source}: no token advantages for rollout "
                                 f"{rollout_id!r}") from None

    def get(self, rollout_id: str) -> np.ndarray:
        """Dense float32 advantages of one rollout, one value per response token."""
        i = self._index(rollout_id)
        if self._dense is not None:
            offsets, values = self._dense
            dense: np.ndarray = values[offsets[i]:offsets[i + 1]].copy()
            return dense
        assert self._spans is not None  # __init__ sets one of the two
        offsets, start, end, value = self._spans
        out = np.zeros(int(self._length[i]), dtype=np.float32)
        for s, e, v in zip(start[offsets[i]:offsets[i + 1]], end[offsets[i]:offsets[i + 1]],
                           value[offsets[i]:offsets[i + 1]]):
            out[s:e] = v
        return out

    def train_step(self, rollout_id: str) -> int | None:
        value = self._train_step[self._index(rollout_id)]
        return None if value < 0 else int(value)

    def batch(
        self,
        rollout_ids: Sequence[str | None],
        response_mask: np.ndarray | None = None,
        *,
        length: int | None = None,
        strict: bool = True,
        train_step: int | Sequence[int] | None = None,
        response_ids: np.ndarray | None = None,
        padding: Sequence[bool] | np.ndarray | None = None,
    ) -> np.ndarray:
        """float32 [B, T] advantages, row b for ``rollout_ids[b]`` (the id trainer row b
        carries), token t of its response.

        T is ``response_mask.shape[1]`` (or ``length``). Responses are right-padded, as verl,
        TRL and OpenRLHF lay them out. With a mask the result is zero where the mask is 0.

        Each row is checked against the file, and any disagreement raises AlignmentError naming
        the rollout and the trainer row:
        - its id must be in the file (no silent zero);
        - ``train_step`` (one int, or one per row) must equal the file's train_step;
        - the mask's count of 1s must equal the file's ``n_policy_tokens``;
        - with ``response_ids`` ([B, >= length] token ids, right-padded), the ids must hash to
          the file's ``response_fingerprint`` where the file has one.
        ``padding[b]`` true marks row b as a padding row (verl's V1 pads the batch): it gets
        zeros and is not looked up. ``strict`` (default) also raises when a non-zero advantage
        would fall on a masked token or past T; ``strict=False`` skips every check and cuts.
        """
        B = len(rollout_ids)
        mask, T = _mask_and_width(response_mask, length, B)
        pad, steps, ids = _row_inputs(B, padding, train_step, response_ids)
        # Whole-batch work, no per-token Python: every row of the result is tiled by
        # segments (zero gap, span, zero gap, ..., zero tail), so one np.repeat writes the
        # [B, T] tensor and one np.add.reduceat over the mask gives both each row's count of
        # policy tokens and the mask under each span.
        row = self._rows(rollout_ids, pad)
        live = np.flatnonzero(row >= 0)
        bad = np.zeros(B, dtype=np.uint8)  # failed checks per row, bit flags
        if strict:
            self._flag_row_checks(bad, row, live, steps, ids)
        sb, start, end, value = self._batch_spans(row, live)
        if strict:
            past = np.maximum(end - np.maximum(start, T), 0)
            hit = np.flatnonzero(past)
            if hit.size:
                over = np.bincount(sb[hit], weights=past[hit], minlength=B)
                bad[over > 0] |= _PAST
        keep = start < T
        sb, start, end, value = sb[keep], start[keep], np.minimum(end[keep], T), value[keep]
        seg_row, first, seg_len, seg_value, span_seg = _tile(B, T, sb, start, end, value)
        if mask is not None and strict:
            pos = np.flatnonzero(seg_len)
            sums = np.zeros(seg_len.size, dtype=np.int64)
            if pos.size:
                sums[pos] = np.add.reduceat(mask.reshape(-1), first[pos], dtype=np.int64)
            counts = np.bincount(seg_row, weights=sums, minlength=B).astype(np.int64)
            self._flag_counts(bad, row, live, counts)
            stray = span_seg[sums[span_seg] != seg_len[span_seg]]
            stray_rows = np.zeros(B, dtype=bool)
            stray_rows[seg_row[stray]] = True
        first_bad = np.flatnonzero(bad)
        if first_bad.size:
            b = int(first_bad[0])
            kind = next(k for k in (_STEP, _COUNT, _FINGERPRINT, _PAST) if bad[b] & k)
            self._raise_row(b, kind, rollout_ids, row, T,
                            mask, steps, sb, start, end)
        if mask is not None and strict and stray_rows.any():
            b = int(np.flatnonzero(stray_rows)[0])
            in_row = span_seg[seg_row[span_seg] == b]
            n_stray = int((seg_len[in_row] - sums[in_row]).sum())
            raise AlignmentError(
                f"rollout {rollout_ids[b]!r} (trainer row {b}): advantages on "
                f"{n_stray} tokens the response mask excludes (observation "
                "or padding tokens): token positions do not match the trainer's")
        out = np.repeat(seg_value, seg_len).reshape(B, T)
        if mask is not None and not strict:
            out *= (mask != 0)
        return out

    def _rows(self, rollout_ids: Sequence[str | None], pad: np.ndarray) -> np.ndarray:
        """File row of each trainer row: -1 for padding rows, -2 for a missing id (None),
        -3 for an id the file lacks."""
        lookup = self._row.get
        row = np.fromiter((-1 if p else (-2 if rid is None else lookup(rid, -3))
                           for rid, p in zip(rollout_ids, pad.tolist())),
                          dtype=np.int64, count=len(rollout_ids))
        if row.size and row.min() < -1:
            b = int(np.flatnonzero(row < -1)[0])
            where = f"trainer row {b}"
            if row[b] == -2:
                raise AlignmentError(f"{where} carries no rollout id and is not marked as padding")
            raise AlignmentError(f"{self.source}: no token advantages for rollout "
                                 f"{rollout_ids[b]!r} ({where})")
        return row

    def _flag_row_checks(self, bad: np.ndarray, row: np.ndarray, live: np.ndarray,
                         steps: np.ndarray | None, ids: np.ndarray | None) -> None:
        """Mark rows whose train step or fingerprint disagrees with the file (the count
        check needs the mask sums and comes later; ``_first_kind`` restores the order)."""
        i = row[live]
        if steps is not None:
            bad[live[self._train_step[i] != steps[live]]] |= _STEP
        if ids is not None:
            wrong = _fingerprint_mismatches(self._fingerprint, ids, live, i, self._length[i])
            bad[wrong] |= _FINGERPRINT

    def _flag_counts(self, bad: np.ndarray, row: np.ndarray, live: np.ndarray,
                     counts: np.ndarray) -> None:
        expected = self._n_policy[row[live]]
        bad[live[(expected >= 0) & (counts[live] != expected)]] |= _COUNT

    def _batch_spans(self, row: np.ndarray, live: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(trainer row, start, end, value) of the spans of every live row, sorted by row."""
        offsets, start, end, value = self._span_arrays()
        i = row[live]
        n = offsets[i + 1] - offsets[i]
        total = int(n.sum())
        take = np.repeat(offsets[i] - (np.cumsum(n) - n), n) + np.arange(total, dtype=np.int64)
        return (np.repeat(live, n), start[take].astype(np.int64), end[take].astype(np.int64),
                value[take].astype(np.float32, copy=False))

    def _span_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._spans is None:  # dense file: runs of equal non-zero value become spans
            assert self._dense is not None  # __init__ sets one of the two
            self._spans = _dense_runs(*self._dense, self._length)
        return self._spans

    def _raise_row(self, b: int, kind: int, rollout_ids: Sequence[str | None], row: np.ndarray,
                   T: int, mask: np.ndarray | None, steps: np.ndarray | None, sb: np.ndarray,
                   start: np.ndarray, end: np.ndarray) -> None:
        rid, i, where = rollout_ids[b], int(row[b]), f"trainer row {b}"
        if kind == _STEP:
            assert steps is not None  # a step check ran
            file_step = int(self._train_step[i])
            if file_step < 0:
                raise AlignmentError(
                    f"rollout {rid!r} ({where}): the file records no train_step, the row claims "
                    f"step {int(steps[b])} (ingest with train_step to check it)")
            raise AlignmentError(
                f"rollout {rid!r} ({where}): the file is from train step {file_step}, the "
                f"row from step {int(steps[b])}")
        if kind == _COUNT:
            assert mask is not None  # a count check ran
            raise AlignmentError(
                f"rollout {rid!r} ({where}): the response mask marks "
                f"{int(np.count_nonzero(mask[b]))} policy tokens, the file expects "
                f"{int(self._n_policy[i])}")
        if kind == _FINGERPRINT:
            raise AlignmentError(
                f"rollout {rid!r} ({where}): the row's response token ids do not match the "
                "file's response_fingerprint (another rollout's tokens)")
        mine = sb == b
        n_past = int(np.maximum(end[mine] - np.maximum(start[mine], T), 0).sum())
        raise AlignmentError(
            f"rollout {rid!r} ({where}): {n_past} non-zero "
            f"advantages lie past the trainer's {T} response tokens")


def _mask_and_width(response_mask: np.ndarray | None, length: int | None, B: int
                    ) -> tuple[np.ndarray | None, int]:
    if response_mask is not None:
        mask = np.asarray(response_mask)
        if mask.ndim != 2 or mask.shape[0] != B:
            raise AlignmentError(f"response_mask has shape {mask.shape}; expected ({B}, T)")
        return mask, mask.shape[1]
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise AlignmentError(f"length {length!r}: the response width, an int >= 0")
        return None, int(length)
    raise AlignmentError("batch(): give response_mask (the trainer's [B, T] mask) or length")


def _row_inputs(B: int, padding: Sequence[bool] | np.ndarray | None,
                train_step: int | Sequence[int] | None, response_ids: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Per-row padding flags, claimed train steps and response token ids, shapes checked."""
    pad = np.zeros(B, dtype=bool) if padding is None else np.asarray(padding, dtype=bool)
    if pad.shape != (B,):
        raise AlignmentError(f"padding has shape {pad.shape}; expected ({B},)")
    steps = None
    if train_step is not None:
        try:
            claimed = np.asarray(train_step, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise AlignmentError(f"train_step {train_step!r}: an int, or one int per row"
                                 ) from None
        if claimed.ndim > 1 or (claimed.ndim == 1 and claimed.shape != (B,)):
            raise AlignmentError(f"train_step has {claimed.size} entries for {B} trainer rows: "
                                 "give one int, or one per row")
        steps = np.broadcast_to(claimed, (B,))
    ids = None
    if response_ids is not None:
        ids = np.asarray(response_ids)
        if ids.ndim != 2 or ids.shape[0] != B:
            raise AlignmentError(f"response_ids has shape {ids.shape}; expected ({B}, T)")
    return pad, steps, ids


# Row checks as bit flags; a row failing several reports the first in this order.
_STEP, _COUNT, _FINGERPRINT, _PAST = 1, 2, 4, 8


def _tile(B: int, T: int, row: np.ndarray, start: np.ndarray, end: np.ndarray,
          value: np.ndarray) -> tuple[np.ndarray, ...]:
    """Segments tiling each of B rows of T tokens: before every span a zero gap, the span,
    and a zero tail to T. Spans are sorted by (row, start), non-overlapping, within 0..T.
    Returns (row, flat start, length, value, index of each span's segment) per segment."""
    k = row.size
    n = np.bincount(row, minlength=B)
    # Segment slots: row b's spans before it take 2 slots each (gap, span), then its tail;
    # span j (in order) is at slot 2j + 1 + its row. Each segment ends where the next begins.
    span_slot = 2 * np.arange(k, dtype=np.int64) + row + 1
    edges = np.empty(2 * k + B + 1, dtype=np.int64)
    edges[2 * (np.cumsum(n) - n) + np.arange(B)] = np.arange(B, dtype=np.int64) * T
    edges[span_slot] = row * T + start
    edges[span_slot + 1] = row * T + end
    edges[-1] = B * T
    seg_value = np.zeros(2 * k + B, dtype=np.float32)
    seg_value[span_slot] = value
    return np.repeat(np.arange(B), 2 * n + 1), edges[:-1], np.diff(edges), seg_value, span_slot


def _fingerprint_mismatches(fps: list[str | None], ids: np.ndarray, live: np.ndarray, i: np.ndarray,
                            lengths: np.ndarray) -> np.ndarray:
    """Trainer rows (of ``live``, file rows ``i``) whose token ids do not hash to the file's
    fingerprint. Hashing dominates the loader's time; hashlib releases the GIL on buffers
    this size, so large batches are hashed by a few threads."""
    width = ids.shape[1]
    native = ids.dtype == np.dtype("<i8") and ids.flags.c_contiguous

    def check(lo: int, hi: int) -> list[int]:
        wrong = []
        for b, fi, n in zip(live[lo:hi].tolist(), i[lo:hi].tolist(), lengths[lo:hi].tolist()):
            fp = fps[fi]
            if fp is None:
                continue
            if n > width:
                wrong.append(b)
                continue
            # A C-contiguous little-endian int64 row is hashed in place (no copy).
            got = (hashlib.blake2b(ids[b, :n].data, digest_size=8).hexdigest() if native
                   else fingerprint(ids[b, :n]))
            if got != fp:
                wrong.append(b)
        return wrong

    workers = min(os.cpu_count() or 1, 8, max(1, live.size // 4096))
    if workers == 1:
        return np.asarray(check(0, live.size), dtype=np.int64)
    cuts: list[int] = np.linspace(0, live.size, workers + 1).astype(int).tolist()
    with ThreadPoolExecutor(workers) as pool:
        parts = pool.map(lambda k: check(cuts[k], cuts[k + 1]), range(workers))
        return np.asarray([b for part in parts for b in part], dtype=np.int64)


def _dense_runs(offsets: np.ndarray, values: np.ndarray, length: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Dense rows as spans: runs of equal non-zero value (offsets, start, end, value)."""
    R = offsets.size - 1
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(R, dtype=np.int64), lengths)
    pos = np.arange(values.size, dtype=np.int64) - offsets[:-1][row]
    nz = values != 0
    new = nz.copy()
    new[1:] &= ~(nz[:-1] & (values[1:] == values[:-1]) & (row[1:] == row[:-1]))
    first = np.flatnonzero(new)
    # a run ends before the next run's start, a zero, or a row change
    stop = np.ones(values.size, dtype=bool)
    stop[:-1] = ~(nz[1:] & ~new[1:])
    last = np.flatnonzero(stop & nz)
    span_row = row[first]
    out = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(np.bincount(span_row, minlength=R), out=out[1:])
    return out, pos[first], pos[last] + 1, values[first].astype(np.float32)


def _list_column(table: pa.Table, name: str) -> pa.ListArray[Any]:
    """A list column as one array (its offsets and values); list-typed by the table contract."""
    return cast("pa.ListArray[Any]", table.column(name).combine_chunks())


def _optional_column(table: pa.Table, name: str, type_: pa.DataType) -> np.ndarray:
    """An integer column as int64 with -1 for null (or all -1 when the file lacks it)."""
    if name not in table.column_names:
        return np.full(table.num_rows, -1, dtype=np.int64)
    col = table.column(name).cast(type_).fill_null(pa.scalar(-1, type_))
    return col.to_numpy().astype(np.int64)


def load_token_advantages(path: str | Path | Sequence[str | Path],
                          rollout_ids: Iterable[str] | None = None) -> TokenAdvantageTable:
    """Read ``token_advantages.parquet``, optionally only the given rollouts.

    ``path`` may be a list of files (several train steps, for async trainers whose batches mix
    rollouts generated at different steps); rollout ids must be unique across them."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    wanted = None if rollout_ids is None else pa.array(list(rollout_ids), type=pa.string())
    tables = []
    for p in paths:
        table = pq.read_table(p)
        if wanted is not None:
            table = table.filter(pc.is_in(table.column("rollout_id"), value_set=wanted))
        tables.append(table)
    return TokenAdvantageTable(pa.concat_tables(tables, promote_options="permissive"),
                               ", ".join(map(str, paths)))


class AdvantageFiles:
    """The token_advantages files a trainer reads step after step (a glob over a run's steps):
    each file is read once, and again only when its mtime or size changes, and indexed by
    rollout id, so a batch reads and holds only the files with its rollouts; a file no batch
    needs is not kept in memory. Rows are those ``load_token_advantages`` would give: a rollout
    id in two files is still refused."""

    def __init__(self) -> None:
        self._stamp: dict[str, tuple[int, int]] = {}
        self._tables: dict[str, pa.Table] = {}     # the files the last batch needed
        self._holder: dict[str, str] = {}          # rollout id -> the file holding it
        self._shared: dict[str, set[str]] = {}     # rollout id -> files, where several hold it

    def load(self, files: Sequence[str], rollout_ids: Iterable[str]) -> TokenAdvantageTable:
        wanted = list(rollout_ids)
        if gone := set(self._stamp) - set(files):
            self._forget(gone)
        for f in files:
            st = os.stat(f)
            if self._stamp.get(f) != (stamp := (st.st_mtime_ns, st.st_size)):
                self._tables[f] = read = pq.read_table(f)
                # ids are non-null strings (the contract draco wrote); the stubs say Any | None
                for rid in cast("list[str]", read.column("rollout_id").to_pylist()):
                    if self._holder.setdefault(rid, f) != f:
                        self._shared.setdefault(rid, {self._holder[rid]}).add(f)
                self._stamp[f] = stamp
        need = {self._holder[r] for r in wanted if r in self._holder}
        need.update(f for r in wanted for f in self._shared.get(r, ()))
        ids = pa.array(wanted, type=pa.string())
        parts = []
        for f in files:
            if f not in need:
                self._tables.pop(f, None)
                continue
            if f not in self._tables:
                self._tables[f] = pq.read_table(f)
            table = self._tables[f]
            parts.append(table.filter(pc.is_in(table.column("rollout_id"), value_set=ids)))
        if not parts:   # none of the batch's rollouts: an empty table says which are missing
            parts = [pq.read_schema(files[0]).empty_table()]
        return TokenAdvantageTable(pa.concat_tables(parts, promote_options="permissive"),
                                   ", ".join(files))

    def _forget(self, gone: set[str]) -> None:
        for f in gone:
            self._stamp.pop(f, None)
            self._tables.pop(f, None)
        self._holder = {r: f for r, f in self._holder.items() if f not in gone}
        for r, fs in list(self._shared.items()):
            if len(left := fs - gone) > 1:
                self._shared[r] = left
            else:   # held by one file again, or by none
                del self._shared[r]
                if left:
                    self._holder[r] = left.pop()


def group_rollout_ids(index: Sequence[Any], sep: str = ":") -> list[str]:
    """Order-based ids: the k-th row of group u in batch order is ``f"{u}{sep}{k}"``.

    Correct only where the batch is provably still in generation order. verl's
    ``balance_batch`` (on by default) and its V1 trainer reorder rows, and then these ids name
    other rollouts. Use the per-row ids of ``draco_cli.trainers`` instead."""
    warnings.warn(
        "group_rollout_ids numbers rows by batch order; after a trainer reorders its batch "
        "(verl balance_batch, the default) they point at other rollouts. Carry a per-row id "
        "instead (see docs/trainers.md).", UserWarning, stacklevel=2)
    seen: dict[Any, int] = {}
    out = []
    for u in index:
        k = seen.get(u, 0)
        seen[u] = k + 1
        out.append(f"{u}{sep}{k}")
    return out
