"""Per-token advantages (SPEC §2 token_advantages): spans and dense forms, exactly convertible.

Values by token class and both forms: see docs/credit.md, "5. Token advantages". The spans form
is canonical (sorted, non-overlapping, equal adjacent ranges merged), which makes round trips
exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.credit.inputs import StepArrays, rollout_chunks, sum_by_offsets
from draco_cli.errors import InputError

if TYPE_CHECKING:
    from draco_cli.options import CreditOptions
    from draco_cli.validate import FlatSpans

SPAN_COLUMNS = ("span_start", "span_end", "span_value")


def _flat(lists: pl.Series) -> np.ndarray:
    """The values of a list column, row after row (empty and null lists contribute none)."""
    return pc.list_flatten(lists.to_arrow()).to_numpy(zero_copy_only=False)


def _series(arr: pa.Array[Any]) -> pl.Series:
    return cast(pl.Series, pl.from_arrow(arr))  # an Array converts to a Series


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array[Any]:
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32, copy=False), type=pa.int32()),
        pa.array(values, type=value_type),
    )


def _canonical(row: np.ndarray, start: np.ndarray, end: np.ndarray, value: np.ndarray,
               n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Drop zero spans, merge touching spans of equal value; inputs sorted by (row, start).
    Returns (offsets per row, start, end, value)."""
    keep = value != 0
    if not keep.all():
        row, start, end, value = row[keep], start[keep], end[keep], value[keep]
    if row.size:
        new = np.ones(row.size, dtype=bool)
        new[1:] = (row[1:] != row[:-1]) | (start[1:] != end[:-1]) | (value[1:] != value[:-1])
        if not new.all():  # some spans merge (steps without gaps between them often do not)
            first = np.flatnonzero(new)
            last = np.append(first[1:], row.size) - 1
            row, start, end, value = row[first], start[first], end[last], value[first]
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=n_rows), out=offsets[1:])
    return offsets, start, end, value


def token_spans(rollouts: pl.DataFrame, sa: StepArrays, step_adv: np.ndarray, adv_r: np.ndarray,
                mode_r: np.ndarray | pl.Series, source: str = "steps",
                policy_spans: pa.Array[Any] | pa.ChunkedArray[Any] | None = None,
                policy_flat: FlatSpans | None = None) -> pl.DataFrame:
    """Spans-form token advantages, one row per rollout of ``rollouts`` (in its order).

    ``sa`` are the steps as ``credit.StepArrays``, ``step_adv`` a_j per step (A_i for rollouts
    not under step credit), ``adv_r`` / ``mode_r`` A_i and credit_mode per rollout.
    ``policy_spans`` (an Arrow list<list<int>> column aligned with ``rollouts``) is taken from
    ``rollouts`` when not given; passing it as Arrow spares converting a nested column that
    can hold tens of millions of spans; ``policy_flat`` is ``validate.flat_policy_spans`` of
    it when the caller has it already (the check at read made it).
    A rollout whose steps all have token_start is laid out by position (length = response_len,
    or the end of its last step when that is null); otherwise its steps are laid end to end in
    step order (length = Σ n_j). Works block by block over rollouts to bound memory.
    """
    R = rollouts.height
    resp = rollouts["response_len"].fill_null(-1).to_numpy().astype(np.int64)
    if policy_spans is not None:
        ps = policy_spans
    elif "policy_spans" in rollouts.columns:
        ps = rollouts["policy_spans"].to_arrow()
    else:
        ps = pa.nulls(R, pa.list_(pa.list_(pa.int32())))
    if isinstance(ps, pa.ChunkedArray):
        ps = ps.combine_chunks()
    has_ps = ps.is_valid().to_numpy(zero_copy_only=False)
    is_step_r = ((mode_r == "step").to_numpy() if isinstance(mode_r, pl.Series)
                 else mode_r == "step")
    length = np.zeros(R, dtype=np.int64)
    pos_r = np.zeros(R, dtype=bool)
    pieces: list[tuple[np.ndarray, ...]] = []
    policy = policy_flat if policy_flat is not None or not has_ps.any() else _flat_policy(ps)
    # Without response_len the response is at least as long as its policy spans (a final
    # message after the last step): the length covers them, whatever the credit mode.
    ps_end = np.full(R, -1, dtype=np.int64)
    if policy is not None and np.any(has_ps & (resp < 0)) and policy.end.size:
        nonempty = np.flatnonzero(np.diff(policy.offsets) > 0)
        ps_end[nonempty] = np.maximum.reduceat(policy.end, policy.offsets[nonempty])
    for r0, r1, s0, s1 in rollout_chunks(sa.offsets):
        Rl = r1 - r0
        rl = np.repeat(np.arange(Rl, dtype=np.int64), sa.M[r0:r1])  # from the offsets alone
        n = sa.n[s0:s1].astype(np.int64)
        ts = sa.token_start[s0:s1]
        M = sa.M[r0:r1]
        rsp = resp[r0:r1]
        no_start = ts < 0
        missing = (np.bincount(rl, weights=no_start, minlength=Rl) if no_start.any()
                   else np.zeros(Rl))
        del no_start
        pos = np.where(M > 0, missing == 0, rsp >= 0)
        every_pos = bool(pos.all())  # the usual case: no end-to-end layout in this block
        if every_pos:
            start = ts.astype(np.int64)
        else:
            # per-rollout values on each step by np.repeat over the run lengths (steps are
            # sorted by rollout): the same values as indexing by ``rl``, cheaper than a gather
            pos_s = np.repeat(pos, M)
            excl = np.cumsum(n) - n
            # each step's rollout's first step: an empty rollout's index may be the block's end
            first_excl = np.append(excl, 0)[sa.offsets[r0:r1] - s0]
            start = np.where(pos_s, ts, excl - np.repeat(first_excl, M))
            del pos_s, excl, first_excl
        end = start + n
        last_end = np.zeros(Rl, dtype=np.int64)
        nonempty = np.flatnonzero(M > 0)
        if nonempty.size:
            last_end[nonempty] = np.maximum.reduceat(end, (sa.offsets[r0:r1] - s0)[nonempty])
        # a step past response_len is one whose rollout's last end is past it; the first such
        # step is looked for only then
        if np.any(pos & (rsp >= 0) & (last_end > rsp)):
            pos_s, rsp_s = np.repeat(pos, M), np.repeat(rsp, M)
            i = int(np.flatnonzero(pos_s & (rsp_s >= 0) & (end > rsp_s))[0])
            rid = sa.rollout_ids[r0 + int(rl[i])]
            raise InputError(
                f"step {int(sa.step[s0 + i])} of rollout {rid!r} ends at token {int(end[i])}, "
                f"past its response_len {int(rsp[rl[i]])}", file=source, field="token_start")
        known = np.where(rsp >= 0, rsp, np.maximum(last_end, ps_end[r0:r1]))
        length[r0:r1] = known if every_pos else np.where(
            pos, known, np.bincount(rl, weights=n, minlength=Rl).astype(np.int64))
        pos_r[r0:r1] = pos

        # Uniform / fallback with known policy spans: every policy token (gap included) gets
        # A_i; otherwise the steps' own ranges carry the values.
        whole = ~is_step_r[r0:r1] & pos & has_ps[r0:r1]
        rr, ss, ee, vv = rl, start, end, step_adv[s0:s1].astype(np.float32)
        if whole.any():
            keep = ~whole[rl]
            rr, ss, ee, vv = rr[keep], ss[keep], ee[keep], vv[keep]
            assert policy is not None  # whole needs has_ps
            lo, hi = int(policy.offsets[r0]), int(policy.offsets[r1])
            local = np.repeat(np.arange(Rl), np.diff(policy.offsets[r0:r1 + 1]))
            pick = whole[local]
            pr = local[pick]
            rr = np.concatenate([rr, pr])
            ss = np.concatenate([ss, policy.start[lo:hi][pick].astype(np.int64)])
            ee = np.concatenate([ee, policy.end[lo:hi][pick].astype(np.int64)])
            vv = np.concatenate([vv, adv_r[r0:r1][pr].astype(np.float32)])
        # Steps come sorted by (rollout, step); sort only where positions disagree.
        if rr.size > 1 and not bool(np.all((rr[1:] > rr[:-1])
                                           | ((rr[1:] == rr[:-1]) & (ss[1:] >= ss[:-1])))):
            order = np.lexsort((ss, rr))
            rr, ss, ee, vv = rr[order], ss[order], ee[order], vv[order]
        off, cs, ce, cv = _canonical(rr, ss, ee, vv, Rl)
        pieces.append((off, cs.astype(np.int32), ce.astype(np.int32), cv))
    if not pieces:  # no rollouts at all
        pieces.append(_canonical(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32),
                                 np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32), R))
    n_policy = _policy_token_counts(ps, has_ps, sa, R, policy)
    counts = np.concatenate([np.diff(off) for off, *_ in pieces])
    offsets = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    start_c, end_c, value_c = (np.concatenate([piece[k] for piece in pieces]) for k in (1, 2, 3))
    table = pa.table({
        "rollout_id": rollouts["rollout_id"].to_arrow(),
        "length": pa.array(length.astype(np.int32)),
        "layout": pa.array(np.where(pos_r, "positions", "end_to_end")),
        "span_start": _list_array(offsets, start_c, pa.int32()),
        "span_end": _list_array(offsets, end_c, pa.int32()),
        "span_value": _list_array(offsets, value_c, pa.float32()),
        **_self_check_columns(rollouts, n_policy),
    })
    return cast(pl.DataFrame, pl.from_arrow(table))  # a Table converts to a DataFrame


def _policy_token_counts(ps: pa.Array[Any], has_ps: np.ndarray, sa: StepArrays, R: int,
                         policy: FlatSpans | None = None) -> np.ndarray:
    """Tokens each rollout's trainer mask should mark 1: the policy spans when known, else
    the step tokens (SPEC §2: without policy_spans the policy tokens are the step tokens).
    ``policy`` is ``_flat_policy(ps)`` when the caller already has it."""
    steps_n = sum_by_offsets(sa.n, sa.offsets)
    if not has_ps.any():
        return steps_n
    policy = policy if policy is not None else _flat_policy(ps)
    # Per-rollout sums as differences of one running integer sum over the spans' offsets,
    # not a float-weighted bincount over tens of millions of spans.
    # (Σ end − Σ start per rollout: integer sums, exact, without a per-span temporary)
    spans_n = (sum_by_offsets(policy.end, policy.offsets)
               - sum_by_offsets(policy.start, policy.offsets))
    return np.where(has_ps, spans_n, steps_n)


def _self_check_columns(rollouts: pl.DataFrame, n_policy: np.ndarray) -> dict[str, pa.Array[Any]]:
    """SPEC §2 self-check columns: what a loader compares with the trainer's rows."""
    R = rollouts.height
    cols: dict[str, pa.Array[Any]] = {"n_policy_tokens": pa.array(n_policy.astype(np.int32))}
    cols["train_step"] = (rollouts["train_step"].cast(pl.Int32).to_arrow()
                          if "train_step" in rollouts.columns else pa.nulls(R, pa.int32()))
    cols["response_fingerprint"] = (
        rollouts["response_fingerprint"].cast(pl.String).to_arrow()
        if "response_fingerprint" in rollouts.columns else pa.nulls(R, pa.string()))
    return cols


def _flat_policy(ps: pa.Array[Any]) -> FlatSpans:
    """policy_spans as ``FlatSpans``: the file's buffers when well formed, else through
    ``_policy_pairs`` (which names a span that is not a pair)."""
    from draco_cli.validate import FlatSpans, flat_policy_spans

    flat = flat_policy_spans(ps)
    if flat is not None:
        return flat
    parent, start, end = _policy_pairs(ps)
    offsets = np.zeros(len(ps) + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent, minlength=len(ps)), out=offsets[1:])
    return FlatSpans(offsets, start, end)


def _policy_pairs(ps: pa.Array[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flatten policy_spans (list<list<int>>) into (rollout index, start, end) arrays."""
    parent = pc.list_parent_indices(ps).to_numpy().astype(np.int64)
    inner = pc.list_flatten(ps)
    if np.any(pc.list_value_length(inner).to_numpy(zero_copy_only=False) != 2):
        raise InputError("a policy span is not a [start, end) pair", file="rollouts",
                         field="policy_spans")
    pairs = pc.list_flatten(inner).to_numpy(zero_copy_only=False).astype(np.int64)
    return parent, pairs[0::2], pairs[1::2]


def spans_to_dense(df: pl.DataFrame) -> pl.DataFrame:
    """Spans form → dense form (``advantages`` of length ``length``), exactly."""
    _require(df, ("length", *SPAN_COLUMNS), "spans")
    lengths = df["length"].to_numpy().astype(np.int64)
    starts_l = df["span_start"]
    n_spans = starts_l.list.len().to_numpy().astype(np.int64)
    row = np.repeat(np.arange(df.height, dtype=np.int64), n_spans)
    start = _flat(starts_l).astype(np.int64)
    end = _flat(df["span_end"]).astype(np.int64)
    value = _flat(df["span_value"]).astype(np.float32)
    if np.any(end > lengths[row]) or np.any(start < 0) or np.any(end < start):
        bad = int(row[np.flatnonzero((end > lengths[row]) | (start < 0) | (end < start))[0]])
        raise InputError(f"a span lies outside 0..length ({int(lengths[bad])})", row=bad,
                         field="span_start")
    offsets = np.zeros(df.height + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.zeros(int(offsets[-1]), dtype=np.float32)
    span_len = end - start
    if span_len.size:
        # Positions of every covered token, without a Python loop over spans.
        base = offsets[row] + start
        run_start = np.cumsum(span_len) - span_len
        idx = np.repeat(base - run_start, span_len) + np.arange(int(span_len.sum()))
        flat[idx] = np.repeat(value, span_len)
    dense = _list_array(offsets, flat, pa.float32())
    return df.drop(SPAN_COLUMNS).with_columns(_series(dense).alias("advantages"))


def dense_to_spans(df: pl.DataFrame) -> pl.DataFrame:
    """Dense form → canonical spans form, exactly."""
    _require(df, ("advantages",), "dense")
    lists = df["advantages"]
    lengths = lists.list.len().to_numpy().astype(np.int64)
    flat = _flat(lists).astype(np.float32)
    row = np.repeat(np.arange(df.height, dtype=np.int64), lengths)
    offsets = np.zeros(df.height + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    pos = np.arange(flat.size, dtype=np.int64) - offsets[row]
    # Each token is a one-token span; _canonical merges runs of equal value.
    out_off, start, end, value = _canonical(row, pos, pos + 1, flat, df.height)
    out = df.drop("advantages").with_columns(
        pl.Series("length", lengths.astype(np.int32)) if "length" not in df.columns
        else pl.col("length"),
    )
    return out.with_columns(
        _series(_list_array(out_off, start.astype(np.int32), pa.int32())).alias("span_start"),
        _series(_list_array(out_off, end.astype(np.int32), pa.int32())).alias("span_end"),
        _series(_list_array(out_off, value, pa.float32())).alias("span_value"),
    )


def _require(df: pl.DataFrame, cols: tuple[str, ...], form: str) -> None:
    for c in cols:
        if c not in df.columns:
            raise InputError(f"token advantages in {form} form need column '{c}'", field=c)


LAYOUT_KEY = "draco.token_layout"


def layout_label(layouts: set[str] | list[str]) -> str:
    """The token_advantages file's ``draco.token_layout``: its rows' one layout, or mixed."""
    found = sorted(set(layouts))
    return found[0] if len(found) == 1 else "mixed"


def token_form(ta: pl.DataFrame, options: CreditOptions) -> pl.DataFrame:
    """Spans-form token advantages in the form asked for (spans, dense or both), their
    ``train_step`` set to ``options.train_step`` where the rollouts did not say."""
    tokens = options.tokens
    if options.train_step is not None:
        ta = ta.with_columns(pl.col("train_step").fill_null(options.train_step))
    if tokens not in ("dense", "both"):
        return ta
    dense = spans_to_dense(ta)
    return dense if tokens == "dense" else dense.with_columns(ta.select(
        "span_start", "span_end", "span_value"))
