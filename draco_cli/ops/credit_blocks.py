"""``credit compute`` over blocks of whole groups of the inputs it has read, each block's
outputs written by a background thread while the next block computes.

Why: at a million rollouts the whole-table computation made gigabytes of fresh temporaries
(on the VMs we measure, touching fresh memory costs about as much as the arithmetic done in
it) and wrote its outputs after it, on one core. Blocks of about ``BLOCK_STEPS`` steps keep
the temporaries small and reused, and Parquet encoding, which releases the GIL, runs on the
other core (docs/credit.md §6).

Everything credit computes depends on one group at most (SPEC §3.3–3.6): the discriminative
filter keeps a criterion by its group's verdicts, rewards and step credit are per rollout, the
group advantage standardises within the group, token spans are per rollout. So a block of
whole groups computes exactly the rows the whole computation would, and the blocks' rows in
order are the whole tables. Blocks are slices of what was read (no copy, no temporary
files), which needs the inputs in the order ingest and the judge write them: each group's
rollouts adjacent, steps and verdicts grouped by rollout in the rollouts' order (a rollout may
have none), one judge, ``retained`` absent, or null or set throughout.

Anything else is left to the whole-table computation, and so is any error a block raises: it
raises its error naming file, row and field exactly as before (a block's outputs are staged,
never published).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.credit import (CreditStats, arrow_runs, combine_stats, compute_credit,
                              index_steps, large_strings)
from draco_cli.io import BlockWriter, OutputSet, contract_table
from draco_cli.options import CreditOptions
from draco_cli.schemas import Reward, StepCredit, TokenAdvantages
from draco_cli.token_advantages import _sum_by_offsets, spans_to_dense, token_spans

if TYPE_CHECKING:
    from draco_cli.validate import FlatSpans

# Steps per block (whole groups: a block may hold one group more). 1M steps (~50k rollouts of
# 20 steps) keeps a block's working set near 100 MiB and its step_credit one Parquet row group;
# the per-block overhead (~10 ms) is then under 2% of the computation.
BLOCK_STEPS = 1 << 20
OUTPUTS = ("rewards.parquet", "step_credit.parquet", "token_advantages.parquet")
LAYOUT_KEY = "draco.token_layout"


class WholeTables(Exception):
    """The inputs need the whole-table computation (see the module's docstring)."""


@dataclass
class BlockPlan:
    """Blocks of rollouts [start, end) of whole groups, and where their rows are."""

    bounds: np.ndarray          # rollout rows where blocks start, and R
    step_offsets: np.ndarray    # rollout i's steps are rows step_offsets[i]:step_offsets[i + 1]
    verdict_offsets: np.ndarray | None  # the same for verdicts (None: no verdicts at all)
    layout: str                 # the token_layout every output row will have, or "mixed"

    def blocks(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self.bounds[:-1], self.bounds[1:])]


def layout_label(layouts: set[str] | list[str]) -> str:
    """The token_advantages file's ``draco.token_layout``: its rows' one layout, or mixed."""
    found = sorted(set(layouts))
    return found[0] if len(found) == 1 else "mixed"


def plan_blocks(r: pl.DataFrame, s: pl.DataFrame, step_ids: pa.ChunkedArray[Any] | None,
                v: pl.DataFrame, v_ids: pa.Table | None, options: CreditOptions,
                block_steps: int | None = None) -> BlockPlan | None:
    """The blocks for inputs as read by ``credit_compute`` (``r`` conformed rollouts, ``s``
    steps with ``step_ids`` their Arrow rollout_id when apart, ``v`` verdicts with ``v_ids``
    their Arrow ids when apart), or None when they need the whole-table computation (few
    steps, or inputs not in ingest's order; see the module's docstring)."""
    block_steps = block_steps or BLOCK_STEPS
    R = r.height
    if s.height <= block_steps or R < 2:
        return None
    group = r["group_id"]
    if group.null_count():
        return None
    head = (group != group.shift(1)).fill_null(True).to_numpy()
    starts = np.flatnonzero(head)
    if starts.size != group.n_unique():  # a group's rollouts are not adjacent
        return None
    rollout_ids = r["rollout_id"]
    if step_ids is None:  # ids that are not clean strings: the whole computation names them
        return None
    step_lengths = rows_per_rollout(step_ids, rollout_ids)
    if step_lengths is None:
        return None
    verdict_offsets = None
    if v_ids is None:
        if v.height:  # ids that were not clean strings: the general path names the problem
            return None
    else:
        judges = pc.unique(v_ids.column("judge"))
        if len(judges) > 1 or (len(judges) and options.judge not in (None, judges[0].as_py())):
            return None
        if "retained" in v.columns and 0 < v["retained"].null_count() < v.height:
            return None  # filled where set, computed where null: only over the whole
        verdict_lengths = rows_per_rollout(v_ids.column("rollout_id"), rollout_ids)
        if verdict_lengths is None:
            return None
        verdict_offsets = _offsets(verdict_lengths)
    step_offsets = _offsets(step_lengths)
    # each cut at the last group start at or before a multiple of block_steps
    at = np.searchsorted(step_offsets[starts], np.arange(block_steps, int(step_offsets[-1]),
                                                        block_steps), side="right") - 1
    bounds = np.unique(np.concatenate([[0], starts[at], [R]]))
    if bounds.size < 3:  # one block: the whole computation is that block
        return None
    return BlockPlan(bounds=bounds, step_offsets=step_offsets, verdict_offsets=verdict_offsets,
                     layout=_predicted_layout(s, step_offsets, r["response_len"]))


def rows_per_rollout(ids: pa.ChunkedArray[Any], rollout_ids: pl.Series) -> np.ndarray | None:
    """How many rows of ``ids`` each rollout of ``rollout_ids`` has, when they come grouped by
    rollout in the rollouts' order (a rollout may have none); None otherwise, or when an id is
    not a rollout's."""
    R = rollout_ids.len()
    if len(ids) == 0:
        return np.zeros(R, dtype=np.int64)
    if ids.null_count:
        return None
    length, value = arrow_runs(ids)
    known = large_strings(rollout_ids)
    if len(value) == R and pc.all(pc.equal(value, known)).as_py():
        return length  # one run per rollout: no hashing
    row = pc.index_in(value, value_set=known)
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


def _predicted_layout(s: pl.DataFrame, step_offsets: np.ndarray, response_len: pl.Series) -> str:
    """The token_layout label of the output, known before its first block is written (it is
    in the file's schema): a rollout's steps all with a token_start are laid out by position,
    any other end to end (``token_spans``). Checked against the
    blocks' rows after."""
    if "token_start" not in s.columns:
        ts_missing = np.ones(s.height, dtype=bool)
    else:
        ts = s["token_start"]
        ts_missing = (ts.is_null() | (ts < 0)).fill_null(True).to_numpy()
    counts = np.diff(step_offsets)
    # a rollout without steps is laid out by position when its response_len is known
    pos = np.where(counts > 0, _sum_by_offsets(ts_missing, step_offsets) == 0,
                   response_len.fill_null(-1).to_numpy() >= 0)
    return "positions" if pos.all() else "end_to_end" if not pos.any() else "mixed"


def token_form(ta: pl.DataFrame, tokens: str) -> pl.DataFrame:
    """Spans-form token advantages in the form asked for (spans, dense or both)."""
    if tokens not in ("dense", "both"):
        return ta
    dense = spans_to_dense(ta)
    return dense if tokens == "dense" else dense.with_columns(ta.select(
        "span_start", "span_end", "span_value"))


def _slice_flat(flat: FlatSpans | None, r0: int, r1: int) -> FlatSpans | None:
    from draco_cli.validate import FlatSpans

    if flat is None:
        return None
    lo, hi = int(flat.offsets[r0]), int(flat.offsets[r1])
    return FlatSpans(offsets=flat.offsets[r0:r1 + 1] - lo, start=flat.start[lo:hi],
                     end=flat.end[lo:hi])


def with_step_ids(step_credit: pl.DataFrame,
                  ids: pl.Series | pa.ChunkedArray[Any] | None) -> pl.DataFrame | pa.Table:
    """step_credit with the steps' Arrow rollout_id as its first column when it was built
    without one (see ``StepArrays.step_rollout_ids``), as the large_string polars would write
    (the cast shares the strings, only offsets are new)."""
    if not isinstance(ids, pa.ChunkedArray):
        return step_credit
    return step_credit.to_arrow().add_column(0, "rollout_id", ids.cast(pa.large_string()))


def credit_by_blocks(plan: BlockPlan, r: pl.DataFrame, spans: pa.Array[Any] | None,
                     flat: FlatSpans | None, s: pl.DataFrame,
                     step_ids: pa.ChunkedArray[Any] | None, v: pl.DataFrame,
                     v_ids: pa.Table | None, out: Any, *, options: CreditOptions, force: bool,
                     steps_source: str, verdicts_source: str) -> CreditStats:
    """``credit_compute``'s outputs into ``out`` and its stats, block by block of ``plan``.
    Raises ``WholeTables`` (or the block's error) when a block cannot stand for its part of
    the whole; nothing is published then."""
    tokens = options.tokens
    kwargs = options.model_dump(exclude={"tokens"})
    parts: list[CreditStats] = []
    scores: list[pl.DataFrame] = []
    layouts: set[str] = set()
    with OutputSet(out, list(OUTPUTS), force=force) as output, \
            BlockWriter(output) as writer:
        meta = output.metadata
        ta_meta = {LAYOUT_KEY: plan.layout, "draco.token_form": tokens, **meta}
        for r0, r1 in plan.blocks():
            s0, s1 = int(plan.step_offsets[r0]), int(plan.step_offsets[r1])
            rb = r.slice(r0, r1 - r0)
            # the plan checked the ids' runs: a block's are a slice of them
            sa = index_steps(s.slice(s0, s1 - s0), rb, steps_source,
                             ids=None if step_ids is None else step_ids.slice(s0, s1 - s0),
                             lengths=np.diff(plan.step_offsets[r0:r1 + 1]))
            vb, vib, vlen = v, None, None
            if plan.verdict_offsets is not None and v_ids is not None:
                v0, v1 = int(plan.verdict_offsets[r0]), int(plan.verdict_offsets[r1])
                vb, vib = v.slice(v0, v1 - v0), v_ids.slice(v0, v1 - v0)
                vlen = np.diff(plan.verdict_offsets[r0:r1 + 1])
            result = compute_credit(rb, sa, vb, verdicts_source=verdicts_source,
                                    steps_source=steps_source, check_verdict_keys=True,
                                    verdict_ids=vib, verdict_lengths=vlen, **kwargs)
            rewards, step_credit = result.rewards, result.step_credit
            writer.write(OUTPUTS[0], contract_table(rewards, Reward, metadata=meta))
            writer.write(OUTPUTS[1], contract_table(with_step_ids(step_credit,
                                                                  sa.step_rollout_ids),
                                                    StepCredit, metadata=meta))
            ta = token_spans(rb, sa, step_credit["advantage"].to_numpy(),
                             rewards["advantage"].to_numpy(), rewards["credit_mode"],
                             steps_source, None if spans is None else spans.slice(r0, r1 - r0),
                             policy_flat=_slice_flat(flat, r0, r1))
            ta = token_form(ta, tokens)
            layouts.update(ta["layout"].unique().to_list())
            writer.write(OUTPUTS[2], contract_table(ta, TokenAdvantages,
                                                    drop_absent_optional=True,
                                                    metadata=ta_meta))
            parts.append(result.stats)
            scores.append(rewards.select("reward", "pass_rate_all"))
            del result, rewards, step_credit, ta, sa
        if layout_label(layouts) != plan.layout:  # the file's label would be wrong
            raise WholeTables
    both = pl.concat(scores)
    return combine_stats(parts, both["reward"], both["pass_rate_all"])
