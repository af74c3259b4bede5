"""Checks of tables against their contracts and against each other (``draco validate``).

Unlike a read, which stops at the first broken rule, validation collects every problem it can
find, each naming file, row and field, so a user fixes a log in one pass.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

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
    spans = df.with_row_index("__row").filter(pl.col("policy_spans").is_not_null())
    if spans.height:
        flat = spans.select("__row", "response_len", pl.col("policy_spans")).explode("policy_spans")
        flat = flat.filter(pl.col("policy_spans").is_not_null()).with_columns(
            pl.col("policy_spans").list.len().alias("__len"),
            pl.col("policy_spans").list.get(0, null_on_oob=True).alias("s"),
            pl.col("policy_spans").list.get(1, null_on_oob=True).alias("e"),
        )
        bad_shape = pl.col("__len") != 2
        rows, n = _rows(flat, bad_shape)
        _report(problems, source, "policy_spans", "a span must be [start, end)",
                [int(flat["__row"][r]) for r in rows], n)
        ok = flat.filter(~bad_shape)
        rows, n = _rows(ok, (pl.col("s") < 0) | (pl.col("e") <= pl.col("s")))
        _report(problems, source, "policy_spans", "span with start < 0 or end <= start",
                sorted({int(ok["__row"][r]) for r in rows}), n)
        rows, n = _rows(ok, pl.col("response_len").is_not_null() & (pl.col("e") > pl.col("response_len")))
        _report(problems, source, "policy_spans", "span ends past response_len",
                sorted({int(ok["__row"][r]) for r in rows}), n)
        order = ok.with_columns(pl.col("e").shift(1).over("__row").alias("prev_e"))
        rows, n = _rows(order, pl.col("prev_e").is_not_null() & (pl.col("s") < pl.col("prev_e")))
        _report(problems, source, "policy_spans", "spans overlap or are out of order",
                sorted({int(order["__row"][r]) for r in rows}), n)
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
