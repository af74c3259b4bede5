"""Every table of one or many run folders as DuckDB views, to query with SQL (docs/sql.md).

Why the call log is read through ``sqlite3`` and why a read-only connection also refuses
statement types: docs/decisions.md, "Output, SQL and stdin/stdout" and "Secrets and a
read-only `draco sql`".
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from draco_cli.errors import InputError, UsageError
from draco_cli.run.folder import TABLES, RunFolder

if TYPE_CHECKING:
    import duckdb  # imported where used: `draco sql` alone needs it

CALL_LOG = "llm_calls.sqlite"
# Per-stage Parquet exports of the call log: the SQLite log itself is the complete one.
SKIP = {"llm_calls"}


@dataclass
class Source:
    """One table of one input: a Parquet file, or an Arrow table already in memory."""

    name: str
    path: Path | None
    train_step: int | None
    run: str
    arrow: pa.Table | None = None


@dataclass
class Catalog:
    sources: list[Source] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # the folders and files given, the only places a read-only connection reads
    roots: list[Path] = field(default_factory=list)


def _manifest(folder: Path) -> dict[str, Any] | None:
    m = folder / "manifest.json"
    if not m.exists():
        return None
    try:
        data = json.loads(m.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"not a readable manifest ({exc})", file=str(m)) from None
    if not isinstance(data, dict):
        raise InputError("not a readable manifest (not a JSON object)", file=str(m))
    return data


def read_call_log(path: Path) -> pa.Table:
    import polars as pl

    # Not through llm.calllog.read_only: its advice for a broken log (restore it, or move it
    # aside) fits a stage about to write one, not a read-only query of any file.
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            cur = conn.execute("SELECT * FROM calls")
            names = [d[0] for d in cur.description]
            # In blocks: Python row tuples of a large log would cost many times its bytes.
            parts = []
            while rows := cur.fetchmany(10_000):
                parts.append(pl.DataFrame(rows, schema=names, orient="row",
                                          infer_schema_length=None).to_arrow())
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise InputError(f"not a draco call log ({exc})", file=str(path)) from None
    if not parts:
        return pl.DataFrame(schema=names).to_arrow() if names else pa.table({})
    return pa.concat_tables(parts, promote_options="permissive")


# Token columns of the call log that ``read_call_totals`` sums.
TOKEN_COLUMNS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens",
                 "reasoning_tokens")


def read_call_totals(path: Path) -> pa.Table:
    """The call log summed per phase and status: ``n_rows`` (call-log rows), each token column
    (nulls as 0) and ``cost_usd`` (null where every row of the group is unpriced), for those columns the log has. SQLite does the
    grouping, so a log of any size costs a few dozen rows of memory."""
    import polars as pl

    from draco_cli.llm.calllog import read_only

    with read_only(path) as (conn, have):
        keys = [c for c in ("phase", "status") if c in have]
        sums = [f"sum(coalesce({c}, 0)) AS {c}" for c in TOKEN_COLUMNS if c in have]
        if "cost_usd" in have:
            # sum(): nulls left out, and NULL where every row is unpriced (unknown, not $0)
            sums.append("sum(cost_usd) AS cost_usd")
        group = f" GROUP BY {', '.join(keys)} ORDER BY {', '.join(keys)}" if keys else ""
        cur = conn.execute(f"SELECT {', '.join([*keys, 'count(*) AS n_rows', *sums])} "
                           f"FROM calls{group}")
        names = [d[0] for d in cur.description]
        rows = cur.fetchall()
    schema = {n: pl.String if n in ("phase", "status") else pl.Float64 if n == "cost_usd"
              else pl.Int64 for n in names}
    return pl.DataFrame(rows, schema=schema, orient="row").to_arrow()


def catalog(paths: list[Path], stdin: pa.Table | None = None, stdin_name: str = "stdin",
            call_totals: bool = False) -> Catalog:
    """What ``paths`` hold: run folders, folders of tables (``draco ingest`` output) or single
    Parquet files; ``stdin`` is a table read from a stream, named ``stdin_name``.
    ``call_totals`` offers the call logs as their totals per phase and status
    (``read_call_totals``, view ``call_totals``) instead of a row per call."""
    cat = Catalog()
    if stdin is not None:
        cat.sources.append(Source(stdin_name, None, None, "<stdin>", stdin))
    for folder in expand_run_roots(paths):
        if not folder.exists():
            raise InputError("no such file or folder", file=str(folder))
        cat.roots.append(folder)
        if folder.suffix == ".sqlite" and folder.is_file():
            cat.sources.append(_call_source(folder, None, str(folder), call_totals))
        elif folder.is_file():
            cat.sources.append(Source(folder.stem, folder, None, str(folder)))
        else:
            _add_folder(cat, folder, call_totals)
    return cat


def _call_source(log: Path, step: int | None, run: str, call_totals: bool) -> Source:
    if call_totals:
        return Source("call_totals", None, step, run, read_call_totals(log))
    return Source("calls", None, step, run, read_call_log(log))


def _add_folder(cat: Catalog, folder: Path, call_totals: bool) -> None:
    """The tables of one folder: those its manifest names, the known names, any other
    Parquet file below it, and its call log."""
    run = str(folder)
    m = _manifest(folder)
    step = m.get("train_step") if m else None
    run_folder = RunFolder.open(folder) if RunFolder.is_run_folder(folder) else None
    found = _manifest_inputs(folder, run_folder, cat.notes)
    # the run folder's own tables, by the name a query uses; anything else found in a run
    # folder (audit outputs, future stages) is added under its file name
    for name, rel in TABLES.items():
        if (folder / rel).exists():
            found[name] = folder / rel
    for p in sorted(folder.rglob("*.parquet")):
        # (dot-folders below the folder are staging and caches; the folder's own path may
        # hold any, and "..")
        if p in found.values() or p.stem in SKIP or any(
                part.startswith(".") for part in p.relative_to(folder).parts):
            continue
        name = p.stem if p.stem not in found else f"{p.parent.name}_{p.stem}"
        found.setdefault(name, p)
    for name, p in found.items():
        cat.sources.append(Source(name, p, step, run))
    log = run_folder.call_log if run_folder is not None else folder / CALL_LOG
    if log.exists():
        cat.sources.append(_call_source(log, step, run, call_totals))
    if not found and not log.exists():
        raise InputError("no draco tables here (no manifest.json, no .parquet files, no "
                         "llm_calls.sqlite)", file=run)


def _manifest_inputs(folder: Path, run_folder: RunFolder | None,
                     notes: list[str]) -> dict[str, Path]:
    """The rollouts and steps tables a run folder's manifest says it ran on, where they are
    now (moved with the folder, or absolute)."""
    found: dict[str, Path] = {}
    if run_folder is None or run_folder.manifest is None:
        return found
    for name in ("rollouts", "steps"):
        rec = run_folder.manifest.inputs.get(name)
        if rec is None:
            continue
        p = run_folder.input(name, verify=False, missing_ok=True)
        if p is not None:
            found[name] = p
        else:
            notes.append(f"{folder}: its {name} table {rec.path} is gone; no "
                         f"{name} view from this folder")
    return found


def expand_run_roots(paths: list[Path]) -> list[Path]:
    """A folder of run folders (``draco run --train-step N -o RUN_ROOT`` writes
    RUN_ROOT/step-N) stands for its run folders, in training-step order."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir() and not (p / "manifest.json").exists():
            runs = [c for c in p.iterdir() if c.is_dir() and (c / "manifest.json").exists()]
            if runs:
                def step(c: Path) -> tuple[bool, Any, str]:
                    s = (_manifest(c) or {}).get("train_step")
                    return (s is None, s if s is not None else 0, c.name)

                out += sorted(runs, key=step)
                continue
        out.append(p)
    return out


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def connect(cat: Catalog, read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with one view per table name, unioned by column name across
    inputs, with ``train_step`` and ``run`` columns. ``read_only``: queries read only the
    inputs (``cat.roots``, the tables' files; the current folder when no path was given) and
    write nothing (docs/sql.md, "Read-only by default")."""
    import duckdb

    con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False}
                         if read_only else {})
    by_name: dict[str, list[Source]] = {}
    for s in cat.sources:
        by_name.setdefault(s.name, []).append(s)
    for name, sources in by_name.items():
        parts = []
        for i, s in enumerate(sources):
            if s.arrow is not None:
                reg = f"__{name}_{i}"
                con.register(reg, s.arrow)
                cols, rel = s.arrow.column_names, _ident(reg)
            else:
                assert s.path is not None  # a source without Arrow data is a file
                try:
                    cols = pq.read_schema(s.path).names
                except (pa.ArrowInvalid, OSError) as exc:
                    raise InputError(f"not a readable Parquet file ({exc})",
                                     file=str(s.path)) from None
                rel = f"read_parquet({_quote(str(s.path))})"
            step = "NULL::INTEGER" if s.train_step is None else f"{int(s.train_step)}::INTEGER"
            if "train_step" in cols:
                # the folder's training step labels its rows (a run made with --train-step N)
                select = f"SELECT * REPLACE (coalesce({step}, train_step::INTEGER) AS train_step)"
            else:
                select = f"SELECT *, {step} AS train_step"
            if "run" not in cols:
                select += f", {_quote(s.run)} AS run"
            parts.append(f"{select} FROM {rel}")
        con.execute(f"CREATE VIEW {_ident(name)} AS " + " UNION ALL BY NAME ".join(parts))
    if "calls" in by_name and "llm_calls" not in by_name:
        con.execute('CREATE VIEW llm_calls AS SELECT * FROM calls')
    if read_only:
        _confine(con, cat)
    return con


def _confine(con: duckdb.DuckDBPyConnection, cat: Catalog) -> None:
    import os

    roots = cat.roots or ([] if any(s.path for s in cat.sources) else [Path.cwd()])
    dirs: set[str] = set()
    files: set[str] = set()
    for p in [*roots, *(s.path for s in cat.sources if s.path is not None)]:
        # as given and as resolved (DuckDB compares the path a query names, made absolute)
        for q in {os.path.abspath(p), str(Path(p).resolve())}:
            (dirs if Path(q).is_dir() else files).add(q)
    con.execute(f"SET allowed_directories = [{', '.join(map(_quote, sorted(dirs)))}]")
    con.execute(f"SET allowed_paths = [{', '.join(map(_quote, sorted(files)))}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


# What a read-only connection runs, by DuckDB's statement type: reading, and changes to its
# own in-memory tables. Everything else (COPY, EXPORT, ATTACH, DETACH, INSTALL/LOAD, PREPARE
# and EXECUTE, VACUUM, ...) is refused.
READ_ONLY_TYPES = frozenset({
    "SELECT", "EXPLAIN", "CREATE", "CREATE_FUNC", "DROP", "ALTER", "INSERT", "UPDATE",
    "DELETE", "MERGE_INTO", "PRAGMA", "CALL", "MULTI", "SET", "VARIABLE_SET", "TRANSACTION",
    "ANALYZE", "RELATION",
})
UNLOCK = "draco sql reads only its inputs and writes nothing; --allow-external lifts this"


def _refuse_writes(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    import duckdb

    locked = con.execute("SELECT current_setting('lock_configuration')").fetchall()[0]
    if not (locked and locked[0]):
        return
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise UsageError(f"SQL: {_first_line(str(exc))}") from None
    for st in statements:
        kind = st.type.name
        words = " ".join(st.query.split())[:60]
        if kind not in READ_ONLY_TYPES:
            raise UsageError(f"SQL: {kind} refused ({words}): {UNLOCK}")
        # EXPLAIN ANALYZE runs the statement it explains
        if kind == "EXPLAIN" and "analy" in st.query.lower():
            raise UsageError(f"SQL: EXPLAIN ANALYZE refused ({words}): {UNLOCK}")


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table | None:
    """Run one or more statements; the last one's result as Arrow (None if it returns none)."""
    import duckdb

    _refuse_writes(con, sql)
    try:
        rel = con.sql(sql)
        # duckdb's stubs leave pyarrow types as Any
        table: pa.Table | None = None if rel is None else rel.to_arrow_table()
    except duckdb.Error as exc:
        text = f"SQL: {_first_line(str(exc))}"
        if "disabled by configuration" in text or "configuration has been locked" in text:
            text += f" ({UNLOCK})"
        raise UsageError(text) from None
    return table


def _first_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return " ".join(x.strip() for x in lines[:2]) if lines else text


def describe(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Each view with its rows and columns: what ``.tables`` shows."""
    table: pa.Table = con.sql(  # duckdb's stubs leave pyarrow types as Any
        "SELECT table_name AS name, "
        "string_agg(column_name, ', ' ORDER BY ordinal_position) AS columns "
        "FROM information_schema.columns WHERE table_schema = 'main' "
        "AND NOT starts_with(table_name, '__') "
        "GROUP BY table_name ORDER BY table_name").to_arrow_table()
    return table
