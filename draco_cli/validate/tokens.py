"""Checks of token-advantage tables and policy spans (shared by credit, the loader and ``draco validate``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.validate.issues import Issue, _combined, _is_list, _issue, _report


@dataclass
class FlatSpans:
    """policy_spans flattened: rollout i's spans are ``start[offsets[i]:offsets[i + 1]]`` /
    ``end[...]``; ``start`` and ``end`` are views of the file's integer buffer (no copy)."""

    offsets: np.ndarray  # int64, one more than rollouts
    start: np.ndarray
    end: np.ndarray


def _is_span_lists(t: Any) -> bool:  # a pa.DataType; list types carry value_type
    return bool(_is_list(t) and _is_list(t.value_type)
                and pa.types.is_integer(t.value_type.value_type))


def flat_policy_spans(spans: pa.Array[Any] | pa.ChunkedArray[Any]) -> FlatSpans | None:
    """policy_spans as ``FlatSpans`` when every span is a pair of non-null bounds (a null
    rollout holding none); None for anything else (``policy_span_issues`` names it)."""
    if not _is_span_lists(spans.type):
        return None
    lists = cast("pa.ListArray[Any]", _combined(spans))  # or LargeListArray: the same accessors
    outer = lists.offsets.to_numpy().astype(np.int64)  # into lists.values (slice-aware)
    if lists.null_count and np.any(np.diff(outer)[~lists.is_valid().to_numpy(
            zero_copy_only=False)]):
        return None  # a null rollout backed by spans: let the general path decide
    first, last = int(outer[0]), int(outer[-1])
    inner = cast("pa.ListArray[Any]", lists.values.slice(first, last - first))
    if inner.null_count:
        return None
    inner_off = inner.offsets.to_numpy()
    if np.any(np.diff(inner_off) != 2):
        return None
    bounds = inner.values.slice(int(inner_off[0]), int(inner_off[-1] - inner_off[0]))
    if bounds.null_count:
        return None
    pairs = bounds.to_numpy()
    return FlatSpans(outer - first, pairs[0::2], pairs[1::2])


def policy_span_issues(spans: pa.Array[Any] | pa.ChunkedArray[Any],
                       response_len: pl.Series | None = None) -> list[Issue]:
    """policy_spans: list<list<int>> of half-open [start, end) pairs, start >= 0, end > start,
    sorted and non-overlapping within a rollout, ending at or before response_len."""
    t = spans.type
    if not _is_span_lists(t):
        return [([], 1, f"expected list<list<int32>>, got {t}")]
    spans = _combined(spans)
    parent = pc.list_parent_indices(spans).to_numpy().astype(np.int64)
    inner = pc.list_flatten(spans)
    lens = pc.list_value_length(inner).fill_null(0).to_numpy(zero_copy_only=False)
    shape = _issue(parent[lens != 2], "a span must be a [start, end) pair")
    if shape:
        return shape
    pairs = pc.list_flatten(inner)
    if pairs.null_count:
        null = pc.is_null(pairs).to_numpy(zero_copy_only=False).reshape(-1, 2).any(axis=1)
        return _issue(parent[null], "a span bound is null")
    bounds = pairs.to_numpy(zero_copy_only=False).astype(np.int64)
    start, end = bounds[0::2], bounds[1::2]
    issues = _issue(parent[(start < 0) | (end <= start)], "span with start < 0 or end <= start")
    if response_len is not None:
        resp = response_len.fill_null(-1).to_numpy().astype(np.int64)[parent]
        issues += _issue(parent[(resp >= 0) & (end > resp)], "span ends past response_len")
    same = parent[1:] == parent[:-1]
    issues += _issue(parent[1:][same & (start[1:] < end[:-1])],
                     "spans overlap or are out of order")
    return issues


def token_advantage_issues(df: pl.DataFrame) -> list[tuple[str, Issue]]:
    """token_advantages: span lists of equal length, each span inside 0..length, non-empty,
    sorted and non-overlapping; a dense list of exactly ``length`` values."""
    out: list[tuple[str, Issue]] = []
    length = df["length"].to_numpy().astype(np.int64)
    if "advantages" in df.columns:
        n = df["advantages"].list.len()
        bad = np.flatnonzero((n.is_not_null() & (n != df["length"])).to_numpy())
        out += [("advantages", i) for i in _issue(bad, "holds a different number of values "
                                                   "than length")]
    if all(c in df.columns for c in ("span_start", "span_end", "span_value")):
        ns = [df[c].list.len().fill_null(0).to_numpy() for c in
              ("span_start", "span_end", "span_value")]
        bad = np.flatnonzero((ns[0] != ns[1]) | (ns[0] != ns[2]))
        issue = _issue(bad, "span_start, span_end and span_value differ in length")
        if issue:
            return out + [("span_start", i) for i in issue]
        row = np.repeat(np.arange(df.height, dtype=np.int64), ns[0])
        start, end = (_combined(pc.list_flatten(_combined(df[c].to_arrow())))
                      .to_numpy(zero_copy_only=False).astype(np.int64)
                      for c in ("span_start", "span_end"))
        out += [("span_start", i) for i in _issue(
            row[(start < 0) | (end <= start) | (end > length[row])],
            "span outside 0..length, or empty")]
        same = row[1:] == row[:-1]
        out += [("span_start", i) for i in _issue(
            row[1:][same & (start[1:] < end[:-1])], "token spans overlap or are out of order")]
    return out


def check_token_advantages(source: str, df: pl.DataFrame) -> list[str]:
    return [p for field, (rows, n, what) in token_advantage_issues(df)
            for p in _report(source, field, what, rows, n)]
