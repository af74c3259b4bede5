"""Token advantages for CREDO credit (SPEC §6): every policy token of step t gets
a_t = β·A_RLOO + (1 − β)·Ĉ_t (no 1/n_j: the action's whole log-probability carries Ĉ_t);
gap tokens get β·A_RLOO; observation tokens 0. Same layout and format as credit compute."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from draco_cli.credit import index_steps
from draco_cli.io import as_frame
from draco_cli.credit.tokens import _canonical, _list_array, _policy_pairs, token_spans


def credo_token_advantages(rollouts: pl.DataFrame, steps: pl.DataFrame, credit: pl.DataFrame,
                           beta: float = 0.0) -> pl.DataFrame:
    sa = index_steps(steps, rollouts, "steps")
    a_t = sa.order().join(credit.select("rollout_id", pl.col("step").cast(pl.Int32),
                                        "advantage"), on=["rollout_id", "step"], how="left",
                          maintain_order="left")["advantage"].fill_null(0.0).to_numpy()
    R = rollouts.height
    # Steps carry a_t and gap tokens 0: the layout of credit compute in step mode.
    base = token_spans(rollouts, sa, a_t, np.zeros(R), np.full(R, "step"))
    if beta == 0 or "policy_spans" not in rollouts.columns:
        return base
    gap = beta * rollouts.select("rollout_id").join(
        credit.group_by("rollout_id").agg(pl.col("rloo").first()), on="rollout_id",
        how="left", maintain_order="left")["rloo"].fill_null(0.0).to_numpy()
    parent, pstart, pend = _policy_pairs(rollouts["policy_spans"].to_arrow())
    # Gap tokens = policy spans minus step ranges: cut each policy span around the steps
    # (a loop over the replayed rollouts, which CREDO keeps few).
    pieces: list[tuple[int, int, int, float]] = []   # rollout, start, end, value
    for r in np.unique(parent):
        lo, hi = sa.offsets[r], sa.offsets[r + 1]
        if np.any(sa.token_start[lo:hi] < 0):
            continue  # no positions: keep the step-only layout
        cuts = sorted(zip(sa.token_start[lo:hi], sa.token_start[lo:hi] + sa.n[lo:hi],
                          a_t[lo:hi]))
        for k in np.flatnonzero(parent == r):
            a, b = int(pstart[k]), int(pend[k])
            pos = a
            for s, e, v in cuts:
                if e <= a or s >= b:
                    continue
                if s > pos:
                    pieces.append((r, pos, s, gap[r]))
                pieces.append((r, max(s, a), min(e, b), v))
                pos = min(e, b)
            if pos < b:
                pieces.append((r, pos, b, gap[r]))
    if not pieces:
        return base
    rr, ss, ee, vv = zip(*pieces)
    r_arr = np.array(rr, dtype=np.int64)
    order = np.lexsort((np.array(ss), r_arr))
    offsets, s_, e_, v_ = _canonical(r_arr[order], np.array(ss, dtype=np.int64)[order],
                                     np.array(ee, dtype=np.int64)[order],
                                     np.array(vv, dtype=np.float32)[order], R)
    with_gap = as_frame(pa.table({
        "span_start": _list_array(offsets, s_.astype(np.int32), pa.int32()),
        "span_end": _list_array(offsets, e_.astype(np.int32), pa.int32()),
        "span_value": _list_array(offsets, v_.astype(np.float32), pa.float32())}))
    use = pl.Series(np.bincount(r_arr, minlength=R) > 0)
    return base.with_columns(
        *[pl.when(use).then(with_gap[c]).otherwise(pl.col(c)).alias(c)
          for c in ("span_start", "span_end", "span_value")])
