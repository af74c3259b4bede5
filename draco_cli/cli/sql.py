from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from draco_cli.cli.output import Format, Json, Report, emit, note, pick_format, warn
from draco_cli.errors import UsageError
from draco_cli.storage import stage

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

SHELL_HELP = """Views: {views}
End a query with ; (it may span lines). .tables lists views and columns; .quit leaves."""


def sql(
    args: Annotated[list[str] | None, typer.Argument(
        metavar="[RUN_DIR...] [QUERY]", show_default=False,
        help="Run folders (draco run), folders of tables (draco ingest), Parquet files or "
        "call logs, or - for a table on stdin; then the query, unless -c gives it. No query: "
        "an interactive shell (or SQL read from a pipe).")] = None,
    command: Annotated[str | None, typer.Option(
        "-c", "--command", help="The query (as duckdb -c): every argument is then an input; "
        "with no input, query files directly, e.g. FROM 'runs/x/rollouts.parquet'.")] = None,
    table: Annotated[str, typer.Option(
        "--table", help="View name for the table read from - (stdin), e.g. verdicts.")]
    = "stdin",
    allow_external: Annotated[bool, typer.Option(
        "--allow-external", metavar="", help="Let the query read any file, write files (COPY, EXPORT), "
        "ATTACH databases and load extensions; by default it reads only the inputs (with no "
        "input, the current folder) and writes nothing.")] = False,
    fmt: Format = None,
    as_json: Json = False,
) -> None:
    """Query every table of your run folders with DuckDB SQL: rollouts, steps, rubrics,
    verdicts, rewards, step_credit, token_advantages and calls (the call log), each unioned
    across folders with train_step and run columns.

    Example: draco sql runs/step-* "SELECT train_step, avg(reward) FROM rewards GROUP BY 1 ORDER BY 1"
    """
    from draco_cli.sql import catalog, connect, run_query

    out_fmt = pick_format(fmt, as_json)
    args = [stage(a) for a in args or []]   # remote inputs (s3://…) fetched
    query = command
    if query is None and args and args[-1] != "-" and not Path(args[-1]).exists():
        query = args.pop()
    for a in args:
        if a != "-" and not Path(a).exists():
            raise UsageError(f"{a}: no such file or folder (the query goes last, or in -c)")
    stream = None
    if "-" in args:
        from draco_cli.io import read_stdin_table

        stream = read_stdin_table(table)
    cat = catalog([Path(a) for a in args if a != "-"], stream, table)
    for line in cat.notes:
        warn(line)
    con = connect(cat, read_only=not allow_external)
    if query is None and sys.stdin.isatty():
        _shell(con, out_fmt)
        return
    if query is None:
        if stream is not None:
            raise UsageError("stdin holds the table: give the query as an argument or with -c")
        query = sys.stdin.read()
        if not query.strip():
            raise UsageError("no query: give one after the folders, with -c, or on stdin")
    if query.strip() in (".tables", ".schema"):
        from draco_cli.sql import describe

        _print(describe(con), out_fmt)
        return
    _print(run_query(con, query), out_fmt)


def _print(result: pa.Table | None, fmt: str) -> None:
    if result is None:
        return
    import polars as pl

    df = pl.from_arrow(result)
    if isinstance(df, pl.Series):
        df = df.to_frame()
    emit(Report([("", df)], document=df.to_dicts()), fmt)
    if fmt == "table":
        note(f"({df.height} row{'s' if df.height != 1 else ''})")


def _shell(con: duckdb.DuckDBPyConnection, fmt: str) -> None:
    import contextlib

    from draco_cli.errors import DracoError
    from draco_cli.sql import describe, run_query

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    views = [str(v) for v in describe(con).column("name").to_pylist()]
    note(SHELL_HELP.format(views=", ".join(views) or "none"))
    buffer: list[str] = []
    while True:
        try:
            line = input("draco> " if not buffer else "   ...> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        stripped = line.strip()
        if not buffer and stripped in (".quit", ".exit", "\\q"):
            return
        if not buffer and stripped in (".tables", ".schema"):
            _print(describe(con), "table")
            continue
        if not buffer and stripped in (".help", "help"):
            note(SHELL_HELP.format(views=", ".join(views)))
            continue
        buffer.append(line)
        if not stripped.endswith(";"):
            continue
        query, buffer = "\n".join(buffer), []
        try:
            _print(run_query(con, query), fmt)
        except DracoError as exc:
            warn(str(exc))
