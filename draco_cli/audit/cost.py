"""What the LLM calls cost: per phase and step, billed against a naive client, by category."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import polars as pl

from draco_cli.errors import InputError
from draco_cli.schemas import CostCategory, CostNaive, polars_schema

if TYPE_CHECKING:

    from draco_cli.llm.prices import PriceTable
from draco_cli.audit.self_judge import _number

_WORD = re.compile(r"[a-z0-9]+")


_STOP = {"the", "a", "an", "of", "to", "and", "or", "in", "on", "for", "with", "is", "are", "be",
         "before", "after", "any", "all", "every", "each", "that", "it", "its", "agent", "task"}


def cost_audit(calls: pl.DataFrame, rollouts: pl.DataFrame | None
               ) -> tuple[pl.DataFrame, pl.DataFrame, float | None]:
    """(per phase, per train_step, projected dollars per 100 train steps)."""
    tokens = ["input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens"]
    c = calls.with_columns(pl.col(tokens).fill_null(0))
    if "train_step" in c.columns and rollouts is not None and c["train_step"].null_count() == c.height:
        c = c.drop("train_step")  # unlabelled: attribute calls through the rollouts instead
    http = pl.col("status").is_in(["ok", "invalid", "truncated", "refused", "http_error"])
    n_calls = http.sum().alias("calls")
    totals = [*[pl.col(t).sum() for t in tokens], _dollars()]
    per_phase = c.group_by("phase").agg(
        n_calls, (pl.col("status") == "ok").sum().alias("answered"), *totals).sort("phase")
    per_step = pl.DataFrame(schema={"train_step": pl.Int32, "cost_usd": pl.Float64})
    projected = None
    if "train_step" in c.columns and c["train_step"].null_count() < c.height:
        # calls already labelled by the run folder they came from; a run folder without a
        # train step keeps its own row (train_step null) rather than vanishing
        per_step = c.group_by("train_step").agg(n_calls, *totals).sort("train_step",
                                                                         nulls_last=True)
        projected = _projected(per_step.drop_nulls("train_step"))
    elif rollouts is not None and "train_step" in rollouts.columns:
        by_rollout = rollouts.select(pl.col("rollout_id").alias("key"), "train_step")
        by_group = rollouts.group_by("group_id").agg(pl.col("train_step").first()) \
            .rename({"group_id": "key"})
        keys = pl.concat([by_rollout, by_group.select("key", "train_step")]).unique("key")
        j = c.join(keys, on="key", how="left")
        per_step = j.filter(pl.col("train_step").is_not_null()).group_by("train_step").agg(
            n_calls, *totals).sort("train_step")
        if per_step.height:
            projected = _projected(per_step)
    return per_phase, per_step, projected


def _dollars() -> pl.Expr:
    """Summed dollars, null where every row is unpriced: the cost is unknown, not $0."""
    return pl.when(pl.col("cost_usd").is_not_null().any()).then(
        pl.col("cost_usd").sum()).alias("cost_usd")


def _projected(per_step: pl.DataFrame) -> float | None:
    if per_step["cost_usd"].null_count() == per_step.height:
        return None   # unpriced
    return _number(per_step["cost_usd"].fill_null(0.0).mean()) * 100


# Rows that carry a paid reply's usage (an http_error or unanswered row paid nothing).
BILLED_STATUS = ["ok", "invalid", "truncated", "refused"]


COST_COLUMNS = ["phase", "provider", "model", "status", "input_tokens", "cached_tokens",
                "cache_write_tokens", "output_tokens", "reasoning_tokens", "cost_usd",
                "batch_id"]


# What `audit cost` needs: the cost columns and the key that attributes a call to a rollout
# or group (a train step through the rollouts); never the prompt or response text.
AUDIT_COST_COLUMNS = [*COST_COLUMNS, "key"]


def _call_key(text: str | None) -> int | None:
    import hashlib

    if text is None:
        return None
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big",
                          signed=True)


_COST_TYPES: dict[str, type[pl.DataType]] = {
    **dict.fromkeys(["phase", "provider", "model", "status", "batch_id", "key"], pl.String),
    **dict.fromkeys(["input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens",
                     "reasoning_tokens", "call_key"], pl.Int64),
    "cost_usd": pl.Float64}


def _typed_cost_rows(df: pl.DataFrame, path: Path) -> pl.DataFrame:
    """The cost rows with the call log's types (an empty or all-null column has none of its
    own); a value of another type is an error naming the file and column, not a wrong sum."""
    for name in df.columns:
        if name in _COST_TYPES and df[name].dtype != _COST_TYPES[name]:
            try:
                df = df.with_columns(pl.col(name).cast(_COST_TYPES[name]))
            except pl.exceptions.PolarsError:
                raise InputError(f"not a draco call log (column {name} holds values that "
                                 f"are not {_COST_TYPES[name].__name__})", file=str(path)
                                 ) from None
    return df


def read_cost_rows(path: str | os.PathLike[str],
                   columns: Sequence[str] = COST_COLUMNS) -> pl.DataFrame:
    """The call log's cost columns (those of ``columns`` it has) and ``call_key`` (one value
    per HTTP reply: the rows a reply with n choices was split into share it), without loading
    prompts or responses. SQLite or its Parquet export."""
    p = Path(path)
    if not p.exists():
        raise InputError("no such call log", file=str(p))
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(p, pre_buffer=False)  # pre-buffering reads whole columns ahead
        have = set(pf.schema_arrow.names)
        cols = [c for c in columns if c in have]
        # in batches: all that is kept of a response is its reply's key
        frames = [cast(pl.DataFrame, pl.from_arrow(b.select(cols))).with_columns(pl.Series(
            "call_key", [_call_key(t) for t in b.column("response").to_pylist()]
            if "response" in have else [None] * b.num_rows, pl.Int64))
            for b in pf.iter_batches(batch_size=1024, columns=[*cols, "response"]
                                     if "response" in have else cols)]
        names = [*cols, "call_key"]
    else:
        from draco_cli.llm.calllog import read_only

        with read_only(p) as (conn, have):
            conn.create_function("call_key", 1, _call_key, deterministic=True)
            cols = [c for c in columns if c in have]
            key_sql = "call_key(response)" if "response" in have else "NULL"
            order = " ORDER BY id" if "id" in have else ""
            cur = conn.execute(f"SELECT {', '.join([*cols, key_sql])} AS call_key "
                               f"FROM calls{order}")
            names = [d[0] for d in cur.description]
            frames = []
            while rows := cur.fetchmany(10_000):
                frames.append(pl.DataFrame(rows, schema=names, orient="row",
                                           infer_schema_length=None))
    if not frames:
        return pl.DataFrame(schema={n: _COST_TYPES.get(n, pl.String) for n in names})
    # each batch typed on its own: one whose column is all null has no type to stack on
    return pl.concat([_typed_cost_rows(f, p) for f in frames], how="vertical")


def billed_vs_naive(calls: pl.DataFrame, prices: PriceTable | None = None) -> pl.DataFrame:
    """Per phase and in total: the tokens and dollars the call log says were billed, next to
    what a naive client would have paid for the same answers — one call per sample (no ``n``),
    every prompt token at the full input price (no prompt caching), no batch discount.

    A reply that answered n samples was logged as n rows sharing its ``call_key`` (or its
    ``response`` text); its prompt is what each of the naive client's n calls would have sent.
    Rows of replay/ models and of models missing from the price table are left out of the
    dollars (``unpriced_rows`` counts them)."""
    from draco_cli.llm.prices import PriceTable

    prices = prices or PriceTable.load()
    schema = polars_schema(CostNaive)
    if calls.height == 0 or "status" not in calls.columns:
        return pl.DataFrame(schema=schema)
    tok = ["input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens"]
    c = calls.filter(pl.col("status").is_in(BILLED_STATUS))
    if "provider" in c.columns:
        c = c.filter(pl.col("provider").fill_null("") != "replay")
    if "call_key" not in c.columns:
        c = c.with_columns((pl.col("response").map_elements(_call_key, return_dtype=pl.Int64)
                            if "response" in c.columns else pl.lit(None, pl.Int64))
                           .alias("call_key"))
    # a slimmed log: no token counts, no batches, no known prices
    absent = {**{t: pl.lit(0, pl.Int64) for t in tok}, "batch_id": pl.lit(None, pl.String),
              "model": pl.lit(None, pl.String), "cost_usd": pl.lit(None, pl.Float64)}
    c = c.with_columns(e.alias(n) for n, e in absent.items() if n not in c.columns)
    c = c.with_row_index("_row").with_columns(
        pl.col(tok).fill_null(0).cast(pl.Int64),
        # a row without a response (older logs) counts as a call of its own
        pl.coalesce(pl.col("call_key"), -pl.col("_row").cast(pl.Int64) - 1).alias("_call"))
    c = c.with_columns((pl.col("input_tokens") + pl.col("cached_tokens")
                        + pl.col("cache_write_tokens")).sum().over("_call").alias("_prompt"))
    c = c.join(_price_columns(c, prices), on="model", how="left").with_columns(
        ((pl.col("_prompt") * pl.col("_p_in") + pl.col("output_tokens") * pl.col("_p_out"))
         / 1e6).alias("_naive"),
        pl.col("_p_in").is_null().alias("_unpriced"))

    c = c.with_columns(pl.lit(1, pl.Int64).alias("naive_calls"),
                       pl.col("_prompt").alias("naive_input_tokens"))
    return _naive_table(c, pl.col("batch_id").is_not_null(),
                        lambda frame, phase, route: frame["_call"].n_unique())


def _naive_table(t: pl.DataFrame, batched: pl.Expr,
                 calls_of: Callable[[pl.DataFrame, str, str], int]) -> pl.DataFrame:
    """The billed-vs-naive rows of ``t`` (rows or sums of rows: ``naive_calls`` each, token
    sums, ``cost_usd``, ``_naive``, ``_unpriced``) per phase and route; ``calls_of`` counts a
    part's distinct replies."""
    tok = ["input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens"]

    def agg(frame: pl.DataFrame, phase: str, route: str) -> dict[str, Any]:
        priced = frame.filter(~pl.col("_unpriced"))
        billed = float(priced["cost_usd"].sum()) if priced.height else None
        naive = float(priced["_naive"].sum()) if priced.height else None
        rows = int(frame["naive_calls"].sum())
        batched_rows = int(frame.filter(batched)["naive_calls"].sum())
        return {"phase": phase, "route": route, "calls": calls_of(frame, phase, route),
                "naive_calls": rows, **{c: int(frame[c].sum()) for c in tok},
                "naive_input_tokens": int(frame["naive_input_tokens"].sum()),
                "batch_share": batched_rows / rows if rows else None,
                "billed_usd": billed, "naive_usd": naive,
                "billed_over_naive": billed / naive if billed is not None and naive else None,
                "unpriced_rows": int(frame.filter(pl.col("_unpriced"))["naive_calls"].sum())}

    rows = []
    phases = sorted(t["phase"].drop_nulls().unique().to_list())
    for ph in [*phases, *(["all"] if t.height else [])]:
        frame = t if ph == "all" else t.filter(pl.col("phase") == ph)
        for route, part in _routes(frame, batched):
            rows.append(agg(part, ph, route))
    return pl.DataFrame(rows, schema=polars_schema(CostNaive))



def _price_columns(frame: pl.DataFrame, prices: PriceTable) -> pl.DataFrame:
    """Per-model input/output price per token (`_p_in`, `_p_out`; null when unknown)."""
    return pl.DataFrame(
        [{"model": m, "_p_in": (p.input if p else None), "_p_out": (p.output if p else None)}
         for m in frame["model"].unique().drop_nulls().to_list() for p in [prices.price(m)]],
        schema={"model": pl.String, "_p_in": pl.Float64, "_p_out": pl.Float64})


def _routes(frame: pl.DataFrame, batched: pl.Expr) -> list[tuple[str, pl.DataFrame]]:
    """A phase's rows apart by route, those through a batch API (half price) and the rest, and
    together: the online figure is the one a caller without batching pays."""
    out = [(route, part) for route, part in (("online", frame.filter(~batched)),
                                            ("batch", frame.filter(batched))) if part.height]
    return [*out, ("all", frame)]


def billed_vs_naive_logs(logs: Sequence[str | os.PathLike[str]],
                         prices: PriceTable | None = None) -> pl.DataFrame:
    """``billed_vs_naive`` of SQLite call logs, summed inside SQLite: no row per call ever
    reaches Python, so memory does not grow with the log (the report's path). The same table,
    up to float rounding, except that a reply found in two logs counts as a call in each."""
    from draco_cli.llm.calllog import read_only
    from draco_cli.llm.prices import PriceTable

    prices = prices or PriceTable.load()
    sums: list[tuple[Any, ...]] = []  # phase, model, batch?, rows, 4 tokens, prompt, cost
    # distinct replies per (phase, route): phase "" is every phase, route "all" both routes
    calls: dict[tuple[str, str], int] = {}
    for log in logs:
        with read_only(log) as (conn, have):
            if "status" not in have:
                continue
            conn.create_function("call_key", 1, _call_key, deterministic=True)
            conn.execute("PRAGMA temp_store = FILE")  # temp tables beyond the page cache
            col = {c: (f"coalesce({c}, 0)" if c.endswith("tokens") else c) if c in have
                   else "NULL" for c in ["phase", "model", "batch_id", "cost_usd",
                                         "input_tokens", "cached_tokens",
                                         "cache_write_tokens", "output_tokens"]}
            where = "status IN ({})".format(", ".join(f"'{s}'" for s in BILLED_STATUS))
            if "provider" in have:
                where += " AND coalesce(provider, '') <> 'replay'"
            # one row per billed row, on disk (temp store): its reply's key, and the
            # reply's whole prompt (a row without a response is a reply of its own)
            conn.execute(f"""CREATE TEMP TABLE billed AS SELECT {col['phase']} AS phase,
                {col['model']} AS model, {col['batch_id']} IS NOT NULL AS batched,
                {col['cost_usd']} AS cost_usd, {col['input_tokens']} AS i,
                {col['cached_tokens']} AS c, {col['cache_write_tokens']} AS w,
                {col['output_tokens']} AS o,
                {'call_key(response)' if 'response' in have else 'NULL'} AS k
                FROM calls WHERE {where}""")
            conn.execute("CREATE TEMP TABLE prompt (k INTEGER PRIMARY KEY, p INTEGER)")
            conn.execute("""INSERT INTO prompt SELECT k, sum(i + c + w) FROM billed
                            WHERE k IS NOT NULL GROUP BY k""")
            sums += conn.execute("""
                SELECT b.phase, b.model, b.batched, count(*), sum(b.i), sum(b.c), sum(b.w),
                       sum(b.o), sum(coalesce(pr.p, b.i + b.c + b.w)), total(b.cost_usd)
                FROM billed b LEFT JOIN prompt pr ON pr.k = b.k
                GROUP BY 1, 2, 3""").fetchall()
            distinct = "count(DISTINCT k) + count(*) - count(k)"  # keyless: 1 each
            route = "CASE WHEN batched THEN 'batch' ELSE 'online' END"
            for phase, r, n in [*conn.execute(
                    f"SELECT phase, {route}, {distinct} FROM billed GROUP BY 1, 2"),
                    *conn.execute(f"SELECT phase, 'all', {distinct} FROM billed GROUP BY 1"),
                    *conn.execute(f"SELECT '', {route}, {distinct} FROM billed GROUP BY 2"),
                    *conn.execute(f"SELECT '', 'all', {distinct} FROM billed")]:
                if phase is not None:
                    calls[phase, r] = calls.get((phase, r), 0) + n
    cols = ["phase", "model", "batched", "naive_calls", "input_tokens", "cached_tokens",
            "cache_write_tokens", "output_tokens", "naive_input_tokens", "cost_usd"]
    t = pl.DataFrame(sums, schema=dict.fromkeys(cols[:2], pl.String) | dict.fromkeys(
        cols[2:-1], pl.Int64) | {"cost_usd": pl.Float64}, orient="row")
    t = t.join(_price_columns(t, prices), on="model", how="left").with_columns(
        ((pl.col("naive_input_tokens") * pl.col("_p_in")
          + pl.col("output_tokens") * pl.col("_p_out")) / 1e6).alias("_naive"),
        pl.col("_p_in").is_null().alias("_unpriced"))
    return _naive_table(t, pl.col("batched") > 0, lambda frame, phase, route: calls.get(
        ("" if phase == "all" else phase, route), 0))


# --- cost by category -----------------------------------------------------------------------

# LLM phases → the paper's cost categories (other phases keep their own name)
PHASE_CATEGORY = {"score": "judge", "generate": "rubric writing", "union": "rubric writing",
                  "merge": "rubric writing", "propose": "candidate scoring",
                  "evolve": "candidate scoring", "match": "audit"}
CATEGORY_ORDER = ["original", "replay", "reconstruction", "judge", "rubric writing",
                  "candidate scoring", "audit"]


def cost_categories(calls: pl.DataFrame | None, rollouts: pl.DataFrame | None = None,
                    steps: pl.DataFrame | None = None,
                    replay_costs: pl.DataFrame | None = None) -> pl.DataFrame:
    """Cost by category (original, replay, reconstruction, judge, rubric writing, candidate
    scoring, environment calls), the one function `audit cost` and the report share: one row
    per category with tokens, environment actions, LLM calls and dollars. Original = the
    rollouts' response tokens (Σ response_len, else Σ step tokens) and their steps; replay and
    reconstruction from `replay run`'s replay_cost table; the rest from the call log by
    phase."""
    rows: list[dict[str, Any]] = []
    if rollouts is not None or steps is not None:
        tokens = None
        if rollouts is not None and "response_len" in rollouts.columns and \
                rollouts["response_len"].null_count() == 0:
            tokens = int(rollouts["response_len"].sum())
        elif steps is not None and "n_tokens" in steps.columns:
            tokens = int(steps["n_tokens"].sum())
        rows.append({"category": "original", "tokens": tokens,
                     "env_actions": steps.height if steps is not None else None})
    if replay_costs is not None:
        rc = replay_costs
        rows.append({"category": "replay", "tokens": int(rc["tokens"].sum()),
                     "env_actions": int(rc["env_actions"].sum())})
        if "reconstruction_tokens" in rc.columns:
            rows.append({"category": "reconstruction",
                         "tokens": int(rc["reconstruction_tokens"].sum()),
                         "env_actions": int(rc["reconstruction_actions"].sum())
                         if "reconstruction_actions" in rc.columns else None})
    if calls is not None and calls.height:
        tok = [c for c in ("input_tokens", "output_tokens", "reasoning_tokens")
               if c in calls.columns]
        http = pl.col("status").is_in(["ok", "invalid", "truncated", "refused", "http_error"])
        if "n_rows" in calls.columns:  # call-log totals (sql.read_call_totals): a line per
            http = pl.when(http).then(pl.col("n_rows")).otherwise(0)  # phase and status
        per = calls.with_columns(
            pl.col("phase").replace_strict(PHASE_CATEGORY, default=pl.col("phase"))
            .alias("category")).group_by("category").agg(
            pl.sum_horizontal([pl.col(c).fill_null(0) for c in tok]).sum().alias("tokens"),
            http.sum().alias("llm_calls"), _dollars())
        for r in per.iter_rows(named=True):
            rows.append({"category": r["category"], "tokens": int(r["tokens"]),
                         "llm_calls": int(r["llm_calls"]),
                         "cost_usd": None if r["cost_usd"] is None else float(r["cost_usd"])})
    order = {c: i for i, c in enumerate(CATEGORY_ORDER)}
    rows.sort(key=lambda r: (order.get(r["category"], len(order)), r["category"]))
    return pl.DataFrame(rows, schema=polars_schema(CostCategory))
