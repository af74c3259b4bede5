"""Trainer side: token advantages as dense numpy arrays aligned with a trainer's response tokens.

Needs numpy and pyarrow only (no torch, no polars), so it imports cheaply inside a training
worker. See docs/trainers.md for verl, TRL and OpenRLHF (draco_cli.integrations.*).

    table = load_token_advantages("run/credit/token_advantages.parquet")
    adv = table.batch(row_ids, response_mask, train_step=step, response_ids=ids)

Rows are matched by the id each trainer row carries, never by batch order, and each row is
checked against the file's self-check columns (train_step, n_policy_tokens,
response_fingerprint): a row that does not fit raises AlignmentError naming the rollout and
the trainer row.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["AlignmentError", "TokenAdvantageTable", "load_token_advantages", "fingerprint",
           "group_rollout_ids"]


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
        self._dense = None
        self._spans = None
        names = table.column_names
        if "advantages" in names and table.column("advantages").null_count < table.num_rows:
            col = table.column("advantages").combine_chunks()
            self._dense = (col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False)
                           .astype(np.float32))
        elif "span_start" in names:
            cols = [table.column(c).combine_chunks() for c in ("span_start", "span_end",
                                                                "span_value")]
            self._spans = (cols[0].offsets.to_numpy(),
                           *[c.values.to_numpy(zero_copy_only=False) for c in cols])
        else:
            raise AlignmentError(f"{source}: neither 'advantages' nor span columns")
        self._train_step = _optional_column(table, "train_step", pa.int64())
        self._n_policy = _optional_column(table, "n_policy_tokens", pa.int64())
        fp = (table.column("response_fingerprint").to_pylist()
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
            return values[offsets[i]:offsets[i + 1]].copy()
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
        if response_mask is not None:
            mask = np.asarray(response_mask)
            if mask.ndim != 2 or mask.shape[0] != len(rollout_ids):
                raise AlignmentError(f"response_mask has shape {mask.shape}; expected "
                                     f"({len(rollout_ids)}, T)")
            T = mask.shape[1]
        elif length is not None:
            mask, T = None, int(length)
        else:
            raise TypeError("give response_mask or length")
        B = len(rollout_ids)
        pad = np.zeros(B, dtype=bool) if padding is None else np.asarray(padding, dtype=bool)
        if pad.shape != (B,):
            raise AlignmentError(f"padding has shape {pad.shape}; expected ({B},)")
        steps = None
        if train_step is not None:
            steps = np.broadcast_to(np.asarray(train_step, dtype=np.int64), (B,))
        ids = None
        if response_ids is not None:
            ids = np.asarray(response_ids)
            if ids.ndim != 2 or ids.shape[0] != B:
                raise AlignmentError(f"response_ids has shape {ids.shape}; expected ({B}, T)")
        out = np.zeros((B, T), dtype=np.float32)
        for b, rid in enumerate(rollout_ids):
            if pad[b]:
                continue
            where = f"trainer row {b}"
            if rid is None:
                raise AlignmentError(f"{where} carries no rollout id and is not marked as padding")
            try:
                i = self._index(rid)
            except AlignmentError as exc:
                raise AlignmentError(f"{exc} ({where})") from None
            if strict:
                self._check_row(i, rid, where, mask, b, steps, ids)
            adv = self.get(rid)
            n = min(adv.size, T)
            if strict and np.any(adv[n:] != 0):
                raise AlignmentError(
                    f"rollout {rid!r} ({where}): {int(np.count_nonzero(adv[n:]))} non-zero "
                    f"advantages lie past the trainer's {T} response tokens")
            out[b, :n] = adv[:n]
        if mask is not None:
            if strict:
                stray = (out != 0) & (mask == 0)
                if stray.any():
                    b = int(np.flatnonzero(stray.any(axis=1))[0])
                    raise AlignmentError(
                        f"rollout {rollout_ids[b]!r} (trainer row {b}): advantages on "
                        f"{int(stray[b].sum())} tokens the response mask excludes (observation "
                        "or padding tokens): token positions do not match the trainer's")
            out *= mask.astype(np.float32)
        return out

    def _check_row(self, i: int, rid: str, where: str, mask: np.ndarray | None, b: int,
                   steps: np.ndarray | None, ids: np.ndarray | None) -> None:
        if steps is not None:
            file_step = int(self._train_step[i])
            if file_step < 0:
                raise AlignmentError(
                    f"rollout {rid!r} ({where}): the file records no train_step, the row claims "
                    f"step {int(steps[b])} (ingest with train_step to check it)")
            if file_step != int(steps[b]):
                raise AlignmentError(
                    f"rollout {rid!r} ({where}): the file is from train step {file_step}, the "
                    f"row from step {int(steps[b])}")
        expected = int(self._n_policy[i])
        if mask is not None and expected >= 0:
            got = int(np.count_nonzero(mask[b]))
            if got != expected:
                raise AlignmentError(
                    f"rollout {rid!r} ({where}): the response mask marks {got} policy tokens, "
                    f"the file expects {expected}")
        fp = self._fingerprint[i]
        if ids is not None and fp is not None:
            n = int(self._length[i])
            if n > ids.shape[1] or fingerprint(ids[b, :n]) != fp:
                raise AlignmentError(
                    f"rollout {rid!r} ({where}): the row's response token ids do not match the "
                    "file's response_fingerprint (another rollout's tokens)")


def _optional_column(table: pa.Table, name: str, type_: pa.DataType) -> np.ndarray:
    """An integer column as int64 with -1 for null (or all -1 when the file lacks it)."""
    if name not in table.column_names:
        return np.full(table.num_rows, -1, dtype=np.int64)
    col = pc.fill_null(table.column(name).cast(type_), -1)
    return col.to_numpy().astype(np.int64)


def load_token_advantages(path: str | Path | Sequence[str | Path],
                          rollout_ids: Iterable[str] | None = None) -> TokenAdvantageTable:
    """Read ``token_advantages.parquet``, optionally only the given rollouts.

    ``path`` may be a list of files (several train steps, for async trainers whose batches mix
    rollouts generated at different steps); rollout ids must be unique across them."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    tables = []
    for p in paths:
        table = pq.read_table(p)
        if rollout_ids is not None:
            wanted = pa.array(list(rollout_ids), type=pa.string())
            table = table.filter(pc.is_in(table.column("rollout_id"), value_set=wanted))
        tables.append(table)
    if len(tables) == 1:
        return TokenAdvantageTable(tables[0], str(paths[0]))
    return TokenAdvantageTable(pa.concat_tables(tables, promote_options="permissive"),
                               ", ".join(map(str, paths)))


def group_rollout_ids(index: Sequence, sep: str = ":") -> list[str]:
    """Order-based ids: the k-th row of group u in batch order is ``f"{u}{sep}{k}"``.

    Correct only where the batch is provably still in generation order. verl's
    ``balance_batch`` (on by default) and its V1 trainer reorder rows, and then these ids name
    other rollouts. Use the per-row ids of ``draco_cli.integrations`` instead."""
    warnings.warn(
        "group_rollout_ids numbers rows by batch order; after a trainer reorders its batch "
        "(verl balance_batch, the default) they point at other rollouts. Carry a per-row id "
        "instead (see docs/trainers.md).", UserWarning, stacklevel=2)
    seen: dict = {}
    out = []
    for u in index:
        k = seen.get(u, 0)
        seen[u] = k + 1
        out.append(f"{u}{sep}{k}")
    return out
