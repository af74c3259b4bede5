"""Trainer side: token advantages as dense numpy arrays aligned with a trainer's response tokens.

Needs numpy and pyarrow only (no torch, no polars), so it imports cheaply inside a training
worker. See docs/trainers.md for verl, TRL and OpenRLHF.

    table = load_token_advantages("run/credit/token_advantages.parquet")
    adv = table.batch(rollout_ids, response_mask)       # float32 [B, T], zero where mask is 0
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["TokenAdvantageTable", "load_token_advantages", "group_rollout_ids"]


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

    def batch(
        self,
        rollout_ids: Sequence[str],
        response_mask: np.ndarray | None = None,
        *,
        length: int | None = None,
        strict: bool = True,
    ) -> np.ndarray:
        """float32 [B, T] advantages, row b for ``rollout_ids[b]``, token t of its response.

        T is ``response_mask.shape[1]`` (or ``length``). Responses are right-padded, as verl,
        TRL and OpenRLHF lay them out. With a mask the result is zero where the mask is 0.
        ``strict`` (default) raises AlignmentError when a non-zero advantage would fall on a
        masked token or past T — the sign that ids, tokenizer or layout do not match.
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
        out = np.zeros((len(rollout_ids), T), dtype=np.float32)
        for b, rid in enumerate(rollout_ids):
            adv = self.get(rid)
            n = min(adv.size, T)
            if strict and np.any(adv[n:] != 0):
                raise AlignmentError(
                    f"rollout {rid!r}: {int(np.count_nonzero(adv[n:]))} non-zero advantages "
                    f"lie past the trainer's {T} response tokens")
            out[b, :n] = adv[:n]
        if mask is not None:
            if strict:
                stray = (out != 0) & (mask == 0)
                if stray.any():
                    b = int(np.flatnonzero(stray.any(axis=1))[0])
                    raise AlignmentError(
                        f"rollout {rollout_ids[b]!r}: advantages on {int(stray[b].sum())} tokens "
                        "the response mask excludes (observation or padding tokens): token "
                        "positions do not match the trainer's")
            out *= mask.astype(np.float32)
        return out


def load_token_advantages(path: str | Path, rollout_ids: Iterable[str] | None = None
                          ) -> TokenAdvantageTable:
    """Read ``token_advantages.parquet``, optionally only the given rollouts."""
    table = pq.read_table(path)
    if rollout_ids is not None:
        wanted = pa.array(list(rollout_ids), type=pa.string())
        table = table.filter(pc.is_in(table.column("rollout_id"), value_set=wanted))
    return TokenAdvantageTable(table, str(path))


def group_rollout_ids(index: Sequence, sep: str = ":") -> list[str]:
    """Rollout ids from a batch's group ids (verl's ``uid``): the k-th row of group u is
    ``f"{u}{sep}{k}"``, k counting from 0 in batch order. Log your rollouts under these ids
    (``rollout_id`` in openai-jsonl) and the batch finds its advantages by ``uid`` alone."""
    seen: dict = {}
    out = []
    for u in index:
        k = seen.get(u, 0)
        seen[u] = k + 1
        out.append(f"{u}{sep}{k}")
    return out
