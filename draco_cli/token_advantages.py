"""Per-token advantages (SPEC §2 token_advantages): spans and dense forms, exactly convertible.

Values by token class: step tokens get their step's a_j; gap tokens (policy tokens in no step)
get 0 under step credit and A_i under ``uniform`` and ``grpo_fallback``; observation tokens 0.

The **spans** form is canonical: half-open [start, end) ranges of equal non-zero float32 value,
sorted, non-overlapping, with adjacent ranges of equal value merged; every token not covered is
0. So dense → spans → dense and spans → dense → spans are both exact.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.errors import InputError

SPAN_COLUMNS = ("span_start", "span_end", "span_value")


def _flat(lists: pl.Series) -> np.ndarray:
    """The values of a list column, row after row (empty and null lists contribute none)."""
    arr = lists.to_arrow()
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return pc.list_flatten(arr).to_numpy(zero_copy_only=False)


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32), type=pa.int32()), pa.array(values, type=value_type)
    )


def _canonical(row: np.ndarray, start: np.ndarray, end: np.ndarray, value: np.ndarray,
               n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Drop zero spans, merge touching spans of equal value; inputs sorted by (row, start).
    Returns (offsets per row, start, end, value)."""
    keep = value != 0
    row, start, end, value = row[keep], start[keep], end[keep], value[keep]
    if row.size:
        new = np.ones(row.size, dtype=bool)
        new[1:] = (row[1:] != row[:-1]) | (start[1:] != end[:-1]) | (value[1:] != value[:-1])
        first = np.flatnonzero(new)
        last = np.append(first[1:], row.size) - 1
        row, start, end, value = row[first], start[first], end[last], value[first]
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=n_rows), out=offsets[1:])
    return offsets, start, end, value


def build_token_advantages(
    rollouts: pl.DataFrame,
    steps: pl.DataFrame,
    step_credit: pl.DataFrame,
    rewards: pl.DataFrame,
    steps_source: str = "steps",
) -> pl.DataFrame:
    """Spans-form token advantages, one row per rollout of ``rollouts`` (in its order).

    A rollout whose steps all have token_start is laid out by position (length =
    response_len, or the end of its last step when that is null); otherwise its steps are laid
    end to end in step order (length = Σ n_j).
    """
    order = rollouts.select("rollout_id", "response_len", "policy_spans").with_row_index("__r")
    modes = order.join(rewards.select("rollout_id", "advantage", "credit_mode"), on="rollout_id",
                       how="left")
    st = (
        steps.select("rollout_id", "step", "n_tokens", "token_start")
        .with_row_index("__row")
        .join(step_credit.select("rollout_id", "step", pl.col("advantage").alias("__a")),
              on=["rollout_id", "step"], how="left")
        .join(modes.select("rollout_id", "__r", "response_len", "advantage", "credit_mode"),
              on="rollout_id", how="left")
        .sort("__r", "step")
    )
    # Layout per rollout: by position only if every step has a token_start.
    st = st.with_columns(pl.col("token_start").is_not_null().all().over("__r").alias("__pos"))
    st = st.with_columns(
        pl.when(pl.col("__pos")).then(pl.col("token_start"))
        .otherwise(pl.col("n_tokens").cum_sum().over("__r") - pl.col("n_tokens"))
        .alias("__start")
    ).with_columns((pl.col("__start") + pl.col("n_tokens")).alias("__end"))
    past = st.filter(pl.col("__pos") & pl.col("response_len").is_not_null()
                     & (pl.col("__end") > pl.col("response_len")))
    if past.height:
        row = past.row(0, named=True)
        raise InputError(
            f"step ends at token {row['__end']}, past response_len {row['response_len']} of "
            f"rollout {row['rollout_id']!r}", file=steps_source, row=int(row["__row"]),
            field="token_start",
        )
    per = st.group_by("__r").agg(
        pl.col("__pos").first().alias("__pos"),
        pl.col("__end").max().alias("__last_end"),
        pl.col("n_tokens").sum().alias("__sum_n"),
    )
    meta = modes.join(per, on="__r", how="left").sort("__r").with_columns(
        # A rollout without steps has positions only if its response length is known.
        pl.col("__pos").fill_null(pl.col("response_len").is_not_null())
    ).with_columns(
        pl.when(pl.col("__pos"))
        .then(pl.coalesce("response_len", "__last_end", pl.lit(0)))
        .otherwise(pl.col("__sum_n").fill_null(0))
        .cast(pl.Int32).alias("length"),
        pl.when(pl.col("__pos")).then(pl.lit("positions")).otherwise(pl.lit("end_to_end"))
        .alias("layout"),
    )

    # Step tokens: a_j under step credit, A_i otherwise.
    step_spans = st.select(
        "__r", "__start", "__end",
        pl.when(pl.col("credit_mode") == "step").then(pl.col("__a"))
        .otherwise(pl.col("advantage")).alias("__v"),
    )
    # Uniform / fallback with known policy spans: every policy token (gap included) gets A_i.
    whole = meta.filter(
        (pl.col("credit_mode") != "step") & pl.col("__pos") & pl.col("policy_spans").is_not_null()
    )
    policy = whole.select("__r", "advantage", "policy_spans").explode("policy_spans").drop_nulls(
        "policy_spans").select(
        "__r",
        pl.col("policy_spans").list.get(0).alias("__start"),
        pl.col("policy_spans").list.get(1).alias("__end"),
        pl.col("advantage").alias("__v"),
    )
    step_spans = step_spans.join(whole.select("__r"), on="__r", how="anti")
    spans = pl.concat([step_spans, policy.cast(step_spans.schema)]).sort("__r", "__start")

    value = spans["__v"].fill_null(0.0).cast(pl.Float32).to_numpy()
    offsets, start, end, value = _canonical(
        spans["__r"].to_numpy().astype(np.int64),
        spans["__start"].to_numpy().astype(np.int64),
        spans["__end"].to_numpy().astype(np.int64),
        value,
        meta.height,
    )
    table = pa.table({
        "rollout_id": meta["rollout_id"].to_arrow(),
        "length": meta["length"].to_arrow(),
        "layout": meta["layout"].to_arrow(),
        "span_start": _list_array(offsets, start.astype(np.int32), pa.int32()),
        "span_end": _list_array(offsets, end.astype(np.int32), pa.int32()),
        "span_value": _list_array(offsets, value.astype(np.float32), pa.float32()),
    })
    return pl.from_arrow(table)


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
    return df.drop(SPAN_COLUMNS).with_columns(pl.from_arrow(dense).alias("advantages"))


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
        pl.from_arrow(_list_array(out_off, start.astype(np.int32), pa.int32())).alias("span_start"),
        pl.from_arrow(_list_array(out_off, end.astype(np.int32), pa.int32())).alias("span_end"),
        pl.from_arrow(_list_array(out_off, value, pa.float32())).alias("span_value"),
    )


def form_of(df: pl.DataFrame) -> str:
    has_dense = "advantages" in df.columns and df["advantages"].null_count() < df.height
    has_spans = all(c in df.columns for c in SPAN_COLUMNS) and \
        df["span_start"].null_count() < df.height
    if has_dense and has_spans:
        return "both"
    if has_dense:
        return "dense"
    if has_spans:
        return "spans"
    return "dense" if "advantages" in df.columns else "spans"


def _require(df: pl.DataFrame, cols: tuple[str, ...], form: str) -> None:
    for c in cols:
        if c not in df.columns:
            raise InputError(f"token advantages in {form} form need column '{c}'", field=c)
