"""``credit compute`` block by block of whole groups, each block read from the input files as
its turn comes and its outputs written by a background thread while the next block computes:
memory is set by the block, not by the number of rollouts, and Parquet's encoding (which
releases the GIL) runs on the other core (docs/credit.md §6).

Everything credit computes depends on one group at most (SPEC §3.3–3.6): the discriminative
filter keeps a criterion by its group's verdicts, rewards and step credit are per rollout, the
group advantage standardises within the group, token spans are per rollout. So a block of
whole groups computes exactly the rows the whole computation would, and the blocks' rows in
order are the whole tables. Reading blocks in turn needs the inputs in the order ingest and
the judge write them: each group's rollouts adjacent, steps and verdicts grouped by rollout
in the rollouts' order (a rollout may have none), one judge, ``retained`` absent, or null or
set throughout. ``plan_blocks`` checks that over the id columns, and what only the whole can
show (unique rollout ids).

Anything else is left to the whole-table computation (``credit.compute``), and so is any error
a block raises: it raises its error naming file, row and field exactly as before (a block's
outputs are staged, never published).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from draco_cli.credit.core import CreditStats, compute_credit
from draco_cli.credit.inputs import (arrow_runs, clean_strings, index_steps, large_strings,
                                     sum_by_offsets)
from draco_cli.credit.tables import (CREDIT_ROLLOUT_COLUMNS, CREDIT_STEP_COLUMNS,
                                     CREDIT_VERDICT_COLUMNS, no_verdicts, rollouts_frame,
                                     steps_frame, verdicts_frame, with_step_ids)
from draco_cli.credit.tokens import LAYOUT_KEY, layout_label, token_form, token_spans
from draco_cli.io import STDIO, BlockWriter, OutputSet, contract_table
from draco_cli.ops import source_name
from draco_cli.options import CreditOptions
from draco_cli.schemas import Reward, StepCredit, TokenAdvantages

# Steps per block (whole groups: a block may hold one group more). 1M steps (~50k rollouts of
# 20 steps) keeps a block's working set near 100 MiB and its step_credit one Parquet row group;
# the per-block overhead (~10 ms) is then under 2% of the computation.
BLOCK_STEPS = 1 << 20
OUTPUTS = ("rewards.parquet", "step_credit.parquet", "token_advantages.parquet")
_READ_ROWS = 1 << 16  # rows per batch read from an input


class WholeTables(Exception):
    """The inputs need the whole-table computation (see the module's docstring)."""


@dataclass
class BlockPlan:
    """Blocks of rollouts [start, end) of whole groups, and where their rows are."""

    bounds: np.ndarray          # rollout rows where blocks start, and R
    step_offsets: np.ndarray    # rollout i's steps are rows step_offsets[i]:step_offsets[i + 1]
    verdict_offsets: np.ndarray | None  # the same for verdicts (None: no verdicts file)
    layout: str                 # the token_layout every output row will have, or "mixed"

    def blocks(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self.bounds[:-1], self.bounds[1:])]


def _column(pf: pq.ParquetFile, name: str) -> pa.ChunkedArray[Any] | None:
    if name not in pf.schema_arrow.names:
        return None
    return pf.read(columns=[name]).column(0)


def plan_blocks(rollouts: str | Path, steps: str | Path, verdicts: str | Path | None,
                options: CreditOptions, block_steps: int | None = None) -> BlockPlan | None:
    """The blocks of these input files, read over their id columns, or None when they need
    the whole-table computation: stdin or an unreadable file, few steps, or inputs not in
    ingest's order (see the module's docstring)."""
    paths = [rollouts, steps] if verdicts is None else [rollouts, steps, verdicts]
    if any(str(p) == STDIO for p in paths):
        return None
    try:
        files = [pq.ParquetFile(p) for p in paths]
        return _plan(files, options, block_steps or BLOCK_STEPS)
    except (pa.ArrowException, OSError, ValueError):
        return None  # the whole-table read names the problem


def _plan(files: list[pq.ParquetFile], options: CreditOptions,
          block_steps: int) -> BlockPlan | None:
    rf, sf = files[0], files[1]
    if sf.metadata.num_rows <= block_steps or rf.metadata.num_rows < 2:
        return None
    rid, group = _column(rf, "rollout_id"), _column(rf, "group_id")
    if not clean_strings(rid) or group is None or group.null_count:
        return None
    assert rid is not None
    if pc.count_distinct(rid).as_py() != len(rid):  # a repeat: the whole-table check names it
        return None
    gs = cast(pl.Series, pl.from_arrow(group))
    head = (gs != gs.shift(1)).fill_null(True).to_numpy()
    starts = np.flatnonzero(head)
    if starts.size != gs.n_unique():  # a group's rollouts are not adjacent
        return None
    rollout_ids = large_strings(cast(pl.Series, pl.from_arrow(rid)))
    step_lengths = rows_per_rollout(_column(sf, "rollout_id"), rollout_ids)
    if step_lengths is None:
        return None
    verdict_offsets = None
    if len(files) == 3:
        vf = files[2]
        judge = _column(vf, "judge")
        if judge is None or judge.null_count:
            return None
        judges = pc.unique(judge).to_pylist()
        if len(judges) > 1 or (judges and options.judge not in (None, judges[0])):
            return None
        retained = _column(vf, "retained")
        if retained is not None and 0 < retained.null_count < len(retained):
            return None  # filled where set, computed where null: only over the whole
        verdict_lengths = rows_per_rollout(_column(vf, "rollout_id"), rollout_ids)
        if verdict_lengths is None:
            return None
        verdict_offsets = _offsets(verdict_lengths)
    step_offsets = _offsets(step_lengths)
    # each cut at the last group start at or before a multiple of block_steps
    at = np.searchsorted(step_offsets[starts], np.arange(block_steps, int(step_offsets[-1]),
                                                        block_steps), side="right") - 1
    bounds = np.unique(np.concatenate([[0], starts[at], [len(rid)]]))
    if bounds.size < 3:  # one block: the whole computation is that block
        return None
    return BlockPlan(bounds=bounds, step_offsets=step_offsets, verdict_offsets=verdict_offsets,
                     layout=_predicted_layout(_column(sf, "token_start"), step_offsets,
                                              _column(rf, "response_len")))


def rows_per_rollout(ids: pa.ChunkedArray[Any] | None,
                     rollout_ids: pa.Array[Any]) -> np.ndarray | None:
    """How many rows of ``ids`` each rollout of ``rollout_ids`` (large_string) has, when they
    come grouped by rollout in the rollouts' order (a rollout may have none); None otherwise,
    or when an id is null or not a rollout's."""
    R = len(rollout_ids)
    if ids is None or not clean_strings(ids):
        return None
    if len(ids) == 0:
        return np.zeros(R, dtype=np.int64)
    length, value = arrow_runs(ids)
    if len(value) == R and pc.all(pc.equal(value, rollout_ids)).as_py():
        return length  # one run per rollout: no hashing
    row = pc.index_in(value, value_set=rollout_ids)
    if row.null_count:  # a row of an unknown rollout
        return None
    rows = row.to_numpy().astype(np.int64)
    if rows.size > 1 and not bool(np.all(rows[1:] > rows[:-1])):  # out of order, or split
        return None
    lengths = np.zeros(R, dtype=np.int64)
    lengths[rows] = length
    return lengths


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _predicted_layout(token_start: pa.ChunkedArray[Any] | None, step_offsets: np.ndarray,
                      response_len: pa.ChunkedArray[Any] | None) -> str:
    """The token_layout label of the output, known before its first block is written (it is
    in the file's schema): a rollout's steps all with a token_start are laid out by position,
    any other end to end (``token_spans``). Checked against the blocks' rows after."""
    n = int(step_offsets[-1])
    if token_start is None:
        ts_missing = np.ones(n, dtype=bool)
    else:
        ts = cast(pl.Series, pl.from_arrow(token_start))
        ts_missing = (ts.is_null() | (ts < 0)).fill_null(True).to_numpy()
    counts = np.diff(step_offsets)
    resp = (np.full(counts.size, -1) if response_len is None else
            cast(pl.Series, pl.from_arrow(response_len)).fill_null(-1).to_numpy())
    # a rollout without steps is laid out by position when its response_len is known
    pos = np.where(counts > 0, sum_by_offsets(ts_missing, step_offsets) == 0, resp >= 0)
    return "positions" if pos.all() else "end_to_end" if not pos.any() else "mixed"


class _Reader:
    """An input file's wanted columns read in order, a given number of rows at a time."""

    def __init__(self, path: str | Path, wanted: list[str]) -> None:
        self.file = pq.ParquetFile(path)
        names = self.file.schema_arrow.names
        self.schema = self.file.schema_arrow
        self.columns = [c for c in wanted if c in names]
        self.batches: Iterator[pa.RecordBatch] = self.file.iter_batches(
            batch_size=_READ_ROWS, columns=self.columns)
        self.buffer: list[pa.RecordBatch] = []
        self.buffered = 0

    def take(self, n: int) -> pa.Table:
        while self.buffered < n:
            batch = next(self.batches)  # the plan counted the file's rows
            self.buffer.append(batch)
            self.buffered += batch.num_rows
        got: list[pa.RecordBatch] = []
        self.buffered -= n
        while n:
            head = self.buffer[0]
            if head.num_rows <= n:
                got.append(self.buffer.pop(0))
                n -= head.num_rows
            else:
                got.append(head.slice(0, n))
                self.buffer[0] = head.slice(n)
                n = 0
        schema = pa.schema([self.schema.field(c) for c in self.columns])
        return pa.Table.from_batches(got, schema=schema)

    def close(self) -> None:
        self.file.close()


def credit_by_blocks(plan: BlockPlan, rollouts: str | Path, steps: str | Path,
                     verdicts: str | Path | None, out: Path, *, options: CreditOptions,
                     force: bool) -> CreditStats:
    """``credit_compute``'s outputs into ``out`` and its stats, block by block of ``plan``.
    Raises ``WholeTables`` (or the block's error) when a block cannot stand for its part of
    the whole; nothing is published then."""
    kwargs = options.model_dump(exclude={"tokens"})
    r_src, s_src = source_name(rollouts), source_name(steps)
    v_src = source_name(verdicts or "verdicts")
    readers = [_Reader(rollouts, CREDIT_ROLLOUT_COLUMNS), _Reader(steps, CREDIT_STEP_COLUMNS)]
    if verdicts is not None:
        readers.append(_Reader(verdicts, CREDIT_VERDICT_COLUMNS))
    parts: list[CreditStats] = []
    scores: list[pl.DataFrame] = []
    layouts: set[str] = set()
    try:
        with OutputSet(out, list(OUTPUTS), force=force) as output, \
                BlockWriter(output) as writer:
            meta = output.metadata
            ta_meta = {LAYOUT_KEY: plan.layout, "draco.token_form": options.tokens, **meta}
            for r0, r1 in plan.blocks():
                s0, s1 = int(plan.step_offsets[r0]), int(plan.step_offsets[r1])
                rb, spans, flat = rollouts_frame(readers[0].take(r1 - r0), r_src)
                s, step_ids = steps_frame(readers[1].take(s1 - s0), s_src)
                # the plan checked the ids' runs: a block's are a slice of them
                sa = index_steps(s, rb, s_src, ids=step_ids,
                                 lengths=np.diff(plan.step_offsets[r0:r1 + 1]))
                del s, step_ids
                vb, vib, vlen = no_verdicts(), None, None
                if plan.verdict_offsets is not None:
                    v0, v1 = int(plan.verdict_offsets[r0]), int(plan.verdict_offsets[r1])
                    vb, vib = verdicts_frame(readers[2].take(v1 - v0), v_src)
                    if vib is not None:
                        vlen = np.diff(plan.verdict_offsets[r0:r1 + 1])
                result = compute_credit(rb, sa, vb, verdicts_source=v_src,
                                        steps_source=s_src, check_verdict_keys=True,
                                        verdict_ids=vib, verdict_lengths=vlen, **kwargs)
                del vb, vib
                rewards, step_credit = result.rewards, result.step_credit
                writer.write(OUTPUTS[0], contract_table(rewards, Reward, metadata=meta))
                writer.write(OUTPUTS[1], contract_table(with_step_ids(step_credit,
                                                                      sa.step_rollout_ids),
                                                        StepCredit, metadata=meta))
                ta = token_spans(rb, sa, step_credit["advantage"].to_numpy(),
                                 rewards["advantage"].to_numpy(), rewards["credit_mode"],
                                 s_src, spans, policy_flat=flat)
                ta = token_form(ta, options.tokens)
                layouts.update(ta["layout"].unique().to_list())
                writer.write(OUTPUTS[2], contract_table(ta, TokenAdvantages,
                                                        drop_absent_optional=True,
                                                        metadata=ta_meta))
                parts.append(result.stats)
                scores.append(rewards.select("reward", "pass_rate_all"))
                del result, rewards, step_credit, ta, sa, rb, spans, flat
            if layout_label(layouts) != plan.layout:  # the file's label would be wrong
                raise WholeTables
    except (pa.ArrowException, OSError, StopIteration):
        raise WholeTables from None  # a file that reads differently now: the whole says so
    finally:
        for reader in readers:
            reader.close()
    both = pl.concat(scores)
    return combine_stats(parts, both["reward"], both["pass_rate_all"])


def combine_stats(parts: list[CreditStats], reward: pl.Series,
                  pass_rate_all: pl.Series) -> CreditStats:
    """The stats of a computation done in parts that share no group, as the whole
    computation's: counts summed, extremes of extremes, and the means over the whole
    ``reward`` and ``pass_rate_all`` columns (the parts' rows, in order: a mean of means would
    round differently)."""
    modes: Counter[str] = Counter()
    for p in parts:
        modes.update(p.credit_modes)
    mins = [p.advantage_min for p in parts if p.advantage_min is not None]
    maxs = [p.advantage_max for p in parts if p.advantage_max is not None]
    return CreditStats(
        groups=sum(p.groups for p in parts),
        rollouts=sum(p.rollouts for p in parts),
        criteria_kept=sum(p.criteria_kept for p in parts),
        criteria_dropped=sum(p.criteria_dropped for p in parts),
        citations_dropped=sum(p.citations_dropped for p in parts),
        credit_modes=dict(sorted(modes.items())),
        advantage_min=min(mins) if mins else None,
        advantage_max=max(maxs) if maxs else None,
        mean_reward=cast("float | None", reward.rechunk().mean()),
        mean_pass_rate_all=cast("float | None", pass_rate_all.rechunk().mean()),
        null_rewards=sum(p.null_rewards for p in parts),
    )
