"""Checks of tables against their contracts and against each other (``draco validate``).

Unlike a read, which stops at the first broken rule, validation collects every problem it can
find, each naming file, row and field, so a user fixes a log in one pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.errors import InputError
from draco_cli.io import conform, read_arrow
from draco_cli.schemas import TABLES, Table

MAX_PER_RULE = 5  # rows listed per broken rule; the count says how many in all


def detect_table(path: str | Path, metadata: dict[bytes, bytes] | None) -> type[Table] | None:
    """The table a file holds: from the metadata draco writes, else from the file name."""
    name = (metadata or {}).get(b"draco.table")
    if name is not None and name.decode() in TABLES:
        return TABLES[name.decode()]
    stem = Path(path).name.split(".")[0]
    return TABLES.get(stem)


def _name(path: str | Path) -> str:
    return "<stdin>" if str(path) == "-" else str(path)


def _rows(df: pl.DataFrame, mask: pl.Expr) -> tuple[list[int], int]:
    idx = df.select(mask.arg_true()).to_series()
    return idx.head(MAX_PER_RULE).to_list(), idx.len()


def _report(problems: list[str], source: str, field: str, what: str, rows: list[int], n: int):
    if n:
        listed = ", ".join(str(r) for r in rows) + (f" and {n - len(rows)} more" if n > len(rows) else "")
        problems.append(f"{source}: row {listed}: field '{field}': {what}")


def validate_paths(paths: list[str | Path]) -> tuple[dict[str, int], list[str]]:
    """Validate files; return (rows per table, problems). Tables are matched to their
    contract by metadata or file name (rollouts.parquet, steps.parquet, ...)."""
    frames: dict[str, tuple[str, pl.DataFrame]] = {}
    problems: list[str] = []
    counts: dict[str, int] = {}
    for path in paths:
        try:
            arrow = read_arrow(path)
            model = detect_table(path, arrow.schema.metadata)
            if model is None:
                problems.append(
                    f"{path}: cannot tell which table this is (name it after the table, "
                    f"e.g. rollouts.parquet, or write it with draco)"
                )
                continue
            df = conform(pl.from_arrow(arrow), model, _name(path))
        except InputError as exc:
            problems.append(str(exc))
            continue
        if model.table_name in frames:
            problems.append(f"{path}: a second '{model.table_name}' table (first: "
                            f"{frames[model.table_name][0]}); validate one set at a time")
            continue
        frames[model.table_name] = (_name(path), df)
        counts[model.table_name] = df.height
    if "rollouts" in frames:
        problems += check_rollouts(*frames["rollouts"])
    if "steps" in frames:
        problems += check_steps(*frames["steps"])
    if "rollouts" in frames and "steps" in frames:
        problems += check_rollouts_steps(frames["rollouts"], frames["steps"])
    for name in ("verdicts", "verdicts_raw"):
        if name in frames and "rollouts" in frames:
            problems += check_known_rollouts(frames[name], frames["rollouts"])
        if name in frames and "steps" in frames:
            problems += check_citations(frames[name], frames["steps"])
    if "token_advantages" in frames:
        problems += check_token_advantages(*frames["token_advantages"])
    return counts, problems


def check_rollouts(source: str, df: pl.DataFrame) -> list[str]:
    problems: list[str] = []
    # One group per task per train step.
    multi = (
        df.group_by("task_id", "train_step")
        .agg(pl.col("group_id").n_unique().alias("n"), pl.col("group_id").unique().alias("g"))
        .filter(pl.col("n") > 1)
    )
    for row in multi.head(MAX_PER_RULE).iter_rows(named=True):
        problems.append(
            f"{source}: field 'group_id': task {row['task_id']!r} at train_step "
            f"{row['train_step']} is split over groups {sorted(row['g'])}"
        )
    if "policy_spans" in df.columns:
        resp = df["response_len"] if "response_len" in df.columns else None
        for rows, n, what in policy_span_issues(df["policy_spans"].to_arrow(), resp):
            _report(problems, source, "policy_spans", what, rows, n)
    return problems


def check_steps(source: str, df: pl.DataFrame) -> list[str]:
    problems: list[str] = []
    ranked = df.with_row_index("__row").with_columns(
        pl.col("step").rank("ordinal").over("rollout_id").cast(pl.Int32).alias("__rank")
    )
    # Report each broken rollout once, at its first step out of place.
    broken = ranked.filter(pl.col("step") != pl.col("__rank")).unique("rollout_id", keep="first",
                                                                      maintain_order=True)
    _report(problems, source, "step", "steps of a rollout must run 1, 2, 3, ... without gaps "
            "or repeats", broken["__row"].head(MAX_PER_RULE).to_list(), broken.height)
    return problems


def check_rollouts_steps(rollouts: tuple[str, pl.DataFrame], steps: tuple[str, pl.DataFrame]):
    problems: list[str] = []
    (rsrc, r), (ssrc, s) = rollouts, steps
    s = s.with_row_index("__row")
    orphan = s.join(r.select("rollout_id"), on="rollout_id", how="anti")
    if orphan.height:
        rows = orphan["__row"].head(MAX_PER_RULE).to_list()
        _report(problems, ssrc, "rollout_id", f"no such rollout in {rsrc}", rows, orphan.height)
    joined = s.join(r.select("rollout_id", "response_len", "policy_spans"), on="rollout_id")
    pos = joined.filter(pl.col("token_start").is_not_null()).with_columns(
        (pl.col("token_start") + pl.col("n_tokens")).alias("__end")
    )
    rows, n = _rows(pos, pl.col("response_len").is_not_null() & (pl.col("__end") > pl.col("response_len")))
    _report(problems, ssrc, "token_start", "step tokens end past the rollout's response_len",
            [int(pos["__row"][i]) for i in rows], n)
    ordered = pos.sort("rollout_id", "token_start").with_columns(
        pl.col("__end").shift(1).over("rollout_id").alias("__prev_end")
    )
    rows, n = _rows(ordered, pl.col("__prev_end").is_not_null()
                    & (pl.col("token_start") < pl.col("__prev_end")))
    _report(problems, ssrc, "token_start", "step token ranges overlap",
            [int(ordered["__row"][i]) for i in rows], n)
    # Steps are policy tokens: each must lie inside one of its rollout's policy spans.
    spanned = pos.filter(pl.col("policy_spans").is_not_null()).with_columns(
        pl.struct("token_start", "__end", "policy_spans").map_elements(
            lambda x: any(sp[0] <= x["token_start"] and x["__end"] <= sp[1]
                          for sp in x["policy_spans"]),
            return_dtype=pl.Boolean,
        ).alias("__inside")
    ) if pos.height and pos["policy_spans"].null_count() < pos.height else None
    if spanned is not None:
        rows, n = _rows(spanned, ~pl.col("__inside"))
        _report(problems, ssrc, "token_start", "step tokens outside the rollout's policy_spans",
                [int(spanned["__row"][i]) for i in rows], n)
    return problems


def check_known_rollouts(table: tuple[str, pl.DataFrame], rollouts: tuple[str, pl.DataFrame]):
    (src, df), (rsrc, r) = table, rollouts
    df = df.with_row_index("__row")
    orphan = df.join(r.select("rollout_id"), on="rollout_id", how="anti")
    problems: list[str] = []
    _report(problems, src, "rollout_id", f"no such rollout in {rsrc}",
            orphan["__row"].head(MAX_PER_RULE).to_list(), orphan.height)
    return problems


# --- checks shared with the commands that read these columns --------------------------------
# Each returns (first rows, how many, what is wrong) per broken rule: validate lists them all,
# a command raises the first (``raise_first``). One check, so validate and the commands that
# compute from these columns can never disagree about what is valid.

Issue = tuple[list[int], int, str]


def _issue(rows: np.ndarray, what: str) -> list[Issue]:
    rows = np.unique(rows)
    return [(rows[:MAX_PER_RULE].tolist(), int(rows.size), what)] if rows.size else []


def _combined(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def policy_span_issues(spans: pa.Array | pa.ChunkedArray,
                       response_len: pl.Series | None = None) -> list[Issue]:
    """policy_spans: list<list<int>> of half-open [start, end) pairs, start >= 0, end > start,
    sorted and non-overlapping within a rollout, ending at or before response_len."""
    t = spans.type
    if not (_is_list(t) and _is_list(t.value_type) and pa.types.is_integer(t.value_type.value_type)):
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
    pairs = pairs.to_numpy(zero_copy_only=False).astype(np.int64)
    start, end = pairs[0::2], pairs[1::2]
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
        start = _combined(pc.list_flatten(_combined(df["span_start"].to_arrow())))
        end = _combined(pc.list_flatten(_combined(df["span_end"].to_arrow())))
        start = start.to_numpy(zero_copy_only=False).astype(np.int64)
        end = end.to_numpy(zero_copy_only=False).astype(np.int64)
        out += [("span_start", i) for i in _issue(
            row[(start < 0) | (end <= start) | (end > length[row])],
            "span outside 0..length, or empty")]
        same = row[1:] == row[:-1]
        out += [("span_start", i) for i in _issue(
            row[1:][same & (start[1:] < end[:-1])], "token spans overlap or are out of order")]
    return out


def raise_first(issues: list[Issue], source: str, field: str) -> None:
    """Raise the first issue as an InputError (how commands use the shared checks)."""
    if issues:
        rows, n, what = issues[0]
        more = f" ({n} rows)" if n > 1 else ""
        raise InputError(what + more, file=source, row=rows[0] if rows else None, field=field)


def check_token_advantages(source: str, df: pl.DataFrame) -> list[str]:
    problems: list[str] = []
    for field, (rows, n, what) in token_advantage_issues(df):
        _report(problems, source, field, what, rows, n)
    return problems


def check_citations(table: tuple[str, pl.DataFrame], steps: tuple[str, pl.DataFrame]):
    """Every cited step exists: 1 <= step <= the rollout's last step."""
    (src, df), (ssrc, s) = table, steps
    last = s.group_by("rollout_id").agg(pl.col("step").max().alias("__M"))
    cited = (df.select("rollout_id", "cited_steps").with_row_index("__row")
             .explode("cited_steps").filter(pl.col("cited_steps").is_not_null())
             .join(last, on="rollout_id", how="left").with_columns(pl.col("__M").fill_null(0)))
    bad = cited.filter((pl.col("cited_steps") < 1) | (pl.col("cited_steps") > pl.col("__M")))
    problems: list[str] = []
    if bad.height:
        first = bad.row(0, named=True)
        rows = sorted(set(bad["__row"].to_list()))
        _report(problems, src, "cited_steps",
                f"cites steps that do not exist in {ssrc} (e.g. step {first['cited_steps']} of "
                f"rollout {first['rollout_id']!r}, which has {first['__M']})",
                rows[:MAX_PER_RULE], len(rows))
    return problems
