"""``credit compute`` block by block of whole groups, each block read from the input files as
its turn comes and written by a background thread while the next computes (docs/credit.md §6;
why, and which inputs take blocks: docs/decisions.md, "`credit compute` by blocks of whole
groups"). Everything credit computes depends on one group at most, so the blocks' rows in
order are the whole tables. ``plan_blocks`` checks the inputs' order over the id columns, and
what only the whole can show (unique rollout ids). Anything else, and any error a block
raises, is left to the whole-table computation (``credit.compute``), which names file, row and
field as before (a block's outputs are staged, never published).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from draco_cli.credit.core import CreditStats, compute_credit, credit_stats
from draco_cli.credit.inputs import (clean_strings, index_steps)
from draco_cli.credit.tables import (CREDIT_ROLLOUT_COLUMNS, CREDIT_STEP_COLUMNS,
                                     CREDIT_VERDICT_COLUMNS, no_verdicts, rollouts_frame,
                                     steps_frame, verdicts_frame, with_step_ids)
from draco_cli.credit.tokens import LAYOUT_KEY, layout_label, token_form, token_spans
from draco_cli.io import STDIO, BlockWriter, OutputSet, contract_table
from draco_cli.publish import source_name
from draco_cli.options import CreditOptions
from draco_cli.schemas import Reward, StepCredit, TokenAdvantages

# Rollouts per block (whole groups: a block may hold one group more). 64k rollouts (~1.3M
# steps at 20 a rollout) keep a block's working set near 100 MiB and the per-block overhead
# (~10 ms) under 2% of the computation.
BLOCK_ROLLOUTS = 1 << 16
OUTPUTS = ("rewards.parquet", "step_credit.parquet", "token_advantages.parquet")
_READ_ROWS = 1 << 16  # rows per batch read from an input


class WholeTables(Exception):
    """The inputs need the whole-table computation (see the module's docstring)."""


@dataclass
class BlockPlan:
    """Blocks of rollouts [start, end) of whole groups, and the rollouts' ids."""

    bounds: np.ndarray          # rollout rows where blocks start, and R
    rollout_ids: pa.Array[Any]  # large_string
    layout: str                 # the token_layout every output row will have, or "mixed"

    def blocks(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self.bounds[:-1], self.bounds[1:])]


def _column(pf: pq.ParquetFile, name: str) -> pa.ChunkedArray[Any] | None:
    if name not in pf.schema_arrow.names:
        return None
    return pf.read(columns=[name]).column(0)


def plan_blocks(rollouts: str | Path, steps: str | Path, verdicts: str | Path | None,
                block_rollouts: int | None = None) -> BlockPlan | None:
    """The blocks of these input files, from the rollouts' ids and groups, or None when they
    need the whole-table computation: stdin or an unreadable file, few rollouts, repeated
    rollout ids, a group's rollouts apart (see the module's docstring)."""
    paths = [rollouts, steps] if verdicts is None else [rollouts, steps, verdicts]
    if any(str(p) == STDIO for p in paths):
        return None
    try:
        rf, sf = pq.ParquetFile(rollouts), pq.ParquetFile(steps)
        return _plan(rf, sf, block_rollouts or BLOCK_ROLLOUTS)
    except (pa.ArrowException, OSError, ValueError):
        return None  # the whole-table read names the problem


def _plan(rf: pq.ParquetFile, sf: pq.ParquetFile, block_rollouts: int) -> BlockPlan | None:
    R = rf.metadata.num_rows
    if block_rollouts >= R or "rollout_id" not in sf.schema_arrow.names:
        return None
    rid, group = _column(rf, "rollout_id"), _column(rf, "group_id")
    if not clean_strings(rid) or group is None or group.null_count:
        return None
    assert rid is not None
    if cast(pl.Series, pl.from_arrow(rid)).n_unique() != R:  # a repeat: the whole names it
        return None
    gs = cast(pl.Series, pl.from_arrow(group))
    head = (gs != gs.shift(1)).fill_null(True).to_numpy()
    starts = np.flatnonzero(head)
    if starts.size != gs.n_unique():  # a group's rollouts are not adjacent
        return None
    # each cut at the last group start at or before a multiple of block_rollouts
    at = np.searchsorted(starts, np.arange(block_rollouts, R, block_rollouts), side="right") - 1
    bounds = np.unique(np.concatenate([[0], starts[at], [R]]))
    if bounds.size < 3:  # one block: the whole computation is that block
        return None
    return BlockPlan(bounds=bounds, rollout_ids=rid.combine_chunks().cast(pa.large_string()),
                     layout=_predicted_layout(sf, _column(rf, "response_len"), R))


def _predicted_layout(sf: pq.ParquetFile, response_len: pa.ChunkedArray[Any] | None,
                      R: int) -> str:
    """The token_layout label of the output, known before its first block is written (it is
    in the file's schema), from the columns alone: every step with a token_start and every
    response_len known is by position, no step with one and no response_len known end to end
    (``token_spans``); anything else is guessed mixed. Checked against the blocks' rows after
    (a wrong guess costs the whole-table computation)."""
    ts = _column(sf, "token_start")
    n = sf.metadata.num_rows
    placed = 0 if ts is None else int(
        cast(pl.Series, pl.from_arrow(ts)).cast(pl.Int64, strict=False).ge(0).sum())
    known = 0 if response_len is None else int(
        cast(pl.Series, pl.from_arrow(response_len)).cast(pl.Int64, strict=False).ge(0).sum())
    if placed == n and known == R:
        return "positions"
    if placed == 0 and known == 0:
        return "end_to_end"
    return "mixed"


class _Reader:
    """An input file's wanted columns read in order, the rows of a block's rollouts at a
    time."""

    def __init__(self, path: str | Path, wanted: list[str]) -> None:
        self.file = pq.ParquetFile(path)
        names = self.file.schema_arrow.names
        self.columns = [c for c in wanted if c in names]
        self.schema = pa.schema([self.file.schema_arrow.field(c) for c in self.columns])
        if "rollout_id" not in names or not (pa.types.is_string(self.schema.field(
                "rollout_id").type) or pa.types.is_large_string(self.schema.field(
                "rollout_id").type)):
            raise WholeTables
        self.batches: Iterator[pa.RecordBatch] = self.file.iter_batches(
            batch_size=_READ_ROWS, columns=self.columns)
        self.buffer: list[pa.RecordBatch] = []

    def take_rollouts(self, ids: set[str]) -> pa.Table:
        """The next rows whose rollout_id is one of ``ids`` (the block's rollouts): whole
        batches while a batch's last row is one of them, then up to the first run of another
        rollout's. (A row of another rollout inside a batch taken whole is found by the
        block's own checks, which then leave the inputs to the whole-table computation.)"""
        got: list[pa.RecordBatch] = []
        while True:
            if not self.buffer:
                batch = next(self.batches, None)
                if batch is None:
                    break
                self.buffer.append(batch)
            head = self.buffer[0]
            col = head.column("rollout_id")
            if col.null_count:
                raise WholeTables
            if col[-1].as_py() in ids:
                got.append(self.buffer.pop(0))
                continue
            ree = pc.run_end_encode(col)  # type: ignore[attr-defined]  # not in the stubs
            inside = [v in ids for v in ree.values.to_pylist()]
            first_out = inside.index(False)
            n = 0 if first_out == 0 else int(ree.run_ends[first_out - 1].as_py())
            if n:
                got.append(head.slice(0, n))
                self.buffer[0] = head.slice(n)
            break
        return pa.Table.from_batches(got, schema=self.schema)

    def done(self) -> bool:
        return not self.buffer and next(self.batches, None) is None

    def close(self) -> None:
        self.file.close()


def credit_by_blocks(plan: BlockPlan, rollouts: str | Path, steps: str | Path,
                     verdicts: str | Path | None, out: Path, *, options: CreditOptions,
                     force: bool) -> CreditStats:
    """``credit_compute``'s outputs into ``out`` and its stats, block by block of ``plan``.
    Raises ``WholeTables`` (or the block's error) when a block cannot stand for its part of
    the whole (steps or verdicts not grouped by rollout in the rollouts' order, several
    judges, ``retained`` null in part); nothing is published then."""
    kwargs = options.credit_args()
    r_src, s_src = source_name(rollouts), source_name(steps)
    v_src = source_name(verdicts or "verdicts")
    readers: list[_Reader] = []
    counts = np.zeros(4, dtype=np.int64)  # groups, criteria kept and dropped, citations dropped
    scores: list[pl.DataFrame] = []
    layouts: set[str] = set()
    judges: set[Any] = set()
    retained = [0, 0]  # verdicts with retained null, and all verdicts
    try:
        readers.append(_Reader(rollouts, CREDIT_ROLLOUT_COLUMNS))
        readers.append(_Reader(steps, CREDIT_STEP_COLUMNS))
        if verdicts is not None:
            readers.append(_Reader(verdicts, CREDIT_VERDICT_COLUMNS))
        with OutputSet(out, list(OUTPUTS), force=force) as output, \
                BlockWriter(output) as writer:
            meta = output.metadata
            ta_meta = {LAYOUT_KEY: plan.layout, "draco.token_form": options.tokens, **meta}
            for r0, r1 in plan.blocks():
                ids = {str(x) for x in plan.rollout_ids.slice(r0, r1 - r0).to_pylist()}
                rb, spans, flat = rollouts_frame(readers[0].take_rollouts(ids), r_src)
                s, step_ids = steps_frame(readers[1].take_rollouts(ids), s_src)
                sa = index_steps(s, rb, s_src, ids=step_ids)
                del s, step_ids
                vb = no_verdicts()
                if verdicts is not None:
                    vt = readers[2].take_rollouts(ids)
                    if "judge" in vt.column_names:
                        judges.update(pc.unique(vt.column("judge")).to_pylist())
                        if len(judges) > 1:  # narrowed (or refused) over the whole
                            raise WholeTables
                    if "retained" in vt.column_names:
                        retained[0] += vt.column("retained").null_count
                        retained[1] += vt.num_rows
                    vb = verdicts_frame(vt, v_src)
                    del vt
                result = compute_credit(rb, sa, vb, verdicts_source=v_src,
                                        steps_source=s_src, check_verdict_keys=True, **kwargs)
                del vb
                rewards, step_credit = result.rewards, result.step_credit
                writer.write(OUTPUTS[0], contract_table(rewards, Reward, metadata=meta))
                writer.write(OUTPUTS[1], contract_table(with_step_ids(step_credit,
                                                                      sa.step_rollout_ids),
                                                        StepCredit, metadata=meta))
                ta = token_spans(rb, sa, step_credit["advantage"].to_numpy(),
                                 rewards["advantage"].to_numpy(), rewards["credit_mode"],
                                 s_src, spans, policy_flat=flat)
                ta = token_form(ta, options)
                layouts.update(ta["layout"].unique().to_list())
                writer.write(OUTPUTS[2], contract_table(ta, TokenAdvantages,
                                                        drop_absent_optional=True,
                                                        metadata=ta_meta))
                st = result.stats
                counts += (st.groups, st.criteria_kept, st.criteria_dropped, st.citations_dropped)
                scores.append(rewards.select("reward", "pass_rate_all", "advantage", "credit_mode"))
                del result, rewards, step_credit, ta, sa, rb, spans, flat
            # rows left: of unknown rollouts, or not grouped in the rollouts' order
            if not all(reader.done() for reader in readers):
                raise WholeTables
            if 0 < retained[0] < retained[1]:  # filled where set, computed where null
                raise WholeTables
            if layout_label(layouts) != plan.layout:  # the file's label would be wrong
                raise WholeTables
    except (pa.ArrowException, OSError, StopIteration):
        raise WholeTables from None  # a file that reads differently now: the whole says so
    finally:
        for reader in readers:
            reader.close()
    # blocks share no group: their counts add up, their rows in order are the whole's
    return credit_stats(pl.concat(scores, rechunk=True), *(int(c) for c in counts))
