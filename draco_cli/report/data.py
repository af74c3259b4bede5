"""The report's inputs: run folders, their manifests, and DuckDB views over their tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import polars as pl

from draco_cli.errors import InputError
from draco_cli.sql import _manifest as _raw_manifest, _quote

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection



_q = _quote  # a text as an SQL string literal

# the redaction applied to every rollout or LLM text (a ``draco_cli.redact.Redactor``)
Redact = Callable[[str], str]


@dataclass
class Run:
    dir: Path
    manifest: dict[str, Any]   # JSON
    label: str  # "step N", or the folder when it has no train step
    step: int | None


def _manifest(run: Path) -> dict[str, Any]:
    from draco_cli.run.folder import RunFolder

    if RunFolder.is_run_folder(run):  # typed, versioned; corrupt manifests named
        manifest = RunFolder.open(run).manifest
        assert manifest is not None  # open() raises when there is none
        return manifest.model_dump(mode="json")
    m = _raw_manifest(run) if run.is_dir() else None
    if m is None:
        raise InputError("not a draco run folder (no manifest.json)", file=str(run))
    return m


def _runs(run_dirs: list[Path]) -> list[Run]:
    from draco_cli.sql import expand_run_roots

    runs = []
    for d in expand_run_roots([Path(x) for x in run_dirs]):
        m = _manifest(Path(d))
        step = m.get("train_step")
        runs.append(Run(Path(d), m, f"step {step}" if step is not None else str(d), step))
    return runs


def _frame(con: DuckDBPyConnection, query: str) -> pl.DataFrame:
    # from_arrow turns a Table into a DataFrame (a Series only from an Array)
    return cast(pl.DataFrame, pl.from_arrow(con.sql(query).to_arrow_table()))


def _views(con: DuckDBPyConnection) -> set[str]:
    return {r[0] for r in con.sql("SELECT table_name FROM information_schema.tables")
            .fetchall()}


def _connect(runs: list[Run]) -> DuckDBPyConnection:
    """DuckDB views over every run folder; each call log as its totals per phase and status
    (``call_totals``): the report never holds a row per call."""
    from draco_cli.sql import catalog, connect

    con = connect(catalog([r.dir for r in runs], call_totals=True), read_only=False)
    # one thread: the report's queries take milliseconds, and each extra thread keeps buffers
    con.execute("SET threads = 1")
    return con


def _q_list(items: list[str]) -> str:
    return ", ".join(_q(x) for x in items) or "NULL"


CRITERIA = "__criteria_counts"  # DuckDB temp table: the run's verdicts per group, criterion


def _verdicts(run: Run, con: DuckDBPyConnection) -> str | None:
    """The run's verdicts counted per group and criterion, with ``retained`` (recomputed as the
    discriminative filter does, with the run's --drop, when the stored table leaves it empty)
    and ``dropout`` (left out of the reward by --rubric-dropout: not retained either), kept in
    DuckDB as temp table ``CRITERIA`` (a large run has tens of thousands of rows: the
    page fetches counts, the first rows and the shown rollouts' groups). None: no verdicts."""
    views = _views(con)
    if not {"verdicts", "rollouts"} <= views:
        return None
    one = _q(str(run.dir))
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {CRITERIA} AS
        SELECT ro.group_id, v.criterion_id,
               count(*) FILTER (WHERE v.verdict = 'pass') AS pass,
               count(*) FILTER (WHERE v.verdict = 'fail') AS fail,
               count(*) FILTER (WHERE v.verdict = 'na') AS na,
               count(*) FILTER (WHERE v.verdict IS NULL) AS unanswered,
               bool_or(v.retained) AS retained, count(v.retained) AS stored,
               false AS dropout
        FROM (SELECT rollout_id, criterion_id, verdict, retained FROM verdicts
              WHERE run = {one}) v
        JOIN (SELECT rollout_id, group_id FROM rollouts WHERE run = {one}) ro
        USING (rollout_id) GROUP BY 1, 2""")
    n, stored = _frame(con, f"SELECT count(*) AS n, sum(stored) AS stored FROM {CRITERIA}").row(0)
    if n and not stored:
        drop = (run.manifest.get("settings") or {}).get("drop") or "all-pass"
        keep = "fail > 0" + (" AND pass + na > 0" if drop == "constant" else "")
        con.execute(f"UPDATE {CRITERIA} SET retained = {keep}")
    con.execute(f"UPDATE {CRITERIA} SET retained = false WHERE retained IS NULL")
    if "rubric_dropout" in views:
        con.execute(f"""UPDATE {CRITERIA} c SET retained = false, dropout = true
                        FROM (SELECT group_id, criterion_id FROM rubric_dropout
                              WHERE run = {one}) d
                        WHERE c.group_id = d.group_id AND c.criterion_id = d.criterion_id""")
    return CRITERIA


def _titles(run: Run, con: DuckDBPyConnection, pairs: pl.DataFrame) -> pl.DataFrame:
    """``pairs`` (group_id, criterion_id) with the criterion's title (its id without one)."""
    title = pl.col("criterion_id")
    if "rubrics" in _views(con) and pairs.height:
        rb = _frame(con, f"""SELECT group_id, criterion_id, first(title) AS title FROM rubrics
                             WHERE run = {_q(str(run.dir))} AND group_id IN
                             ({_q_list(pairs["group_id"].unique().to_list())}) GROUP BY 1, 2""")
        pairs = pairs.join(rb, on=["group_id", "criterion_id"], how="left",
                           maintain_order="left")
        title = pl.coalesce("title", "criterion_id")
    return pairs.with_columns(title.alias("title"))


def _verdict_details(run: Run, con: DuckDBPyConnection, counts: str,
                     ids: list[str]) -> pl.DataFrame:
    """The verdicts of rollouts ``ids`` (a few hundred) with reasons, citations, titles and
    their criterion's ``retained`` from table ``counts`` (``_verdicts``)."""
    v = _frame(con, f"""
        SELECT v.rollout_id, ro.group_id, v.criterion_id, v.verdict, v.cited_steps, v.reason
        FROM verdicts v JOIN rollouts ro ON ro.rollout_id = v.rollout_id AND ro.run = v.run
        WHERE v.run = {_q(str(run.dir))} AND v.rollout_id IN ({_q_list(ids)})""")
    per = _frame(con, f"SELECT group_id, criterion_id, retained FROM {counts} WHERE group_id "
                      f"IN ({_q_list(v['group_id'].drop_nulls().unique().to_list())})")
    v = v.join(per, on=["group_id", "criterion_id"], how="left", maintain_order="left")
    return _titles(run, con, v)
