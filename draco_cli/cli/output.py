"""How reporting commands print: results on stdout, messages on stderr, ``--format
table|json|csv`` (see docs/decisions.md, "Output, SQL and stdin/stdout"). Tables are wide enough
not to cut words when piped; warnings, progress and "wrote FILE" go to stderr in every format.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console

from draco_cli.cli.console import err_console

if TYPE_CHECKING:
    import polars as pl
    from rich.table import Table as RichTable

Format = Annotated[Literal["table", "json", "csv"] | None, typer.Option(
    "--format", show_default=False,
    help="How results are printed on stdout: table (aligned, for reading; the default), json "
    "(one JSON document) or csv (the main table). Messages go to stderr.")]
Json = Annotated[bool, typer.Option("--json", metavar="", help="Same as --format json.")]


def pick_format(fmt: str | None, as_json: bool) -> str:
    if as_json and fmt not in (None, "json"):
        raise typer.BadParameter(f"--json conflicts with --format {fmt}", param_hint="--json")
    return "json" if as_json else (fmt or "table")


@dataclass
class Report:
    """What a command prints. ``tables`` are (title, frame) pairs, the first being the main
    table (the one csv prints); ``document`` is the JSON form (by default every table as a list
    of rows under its key); ``lines`` follow the tables in table form (totals, hints)."""

    tables: list[tuple[str, Any]] = field(default_factory=list)
    document: Any = None
    lines: list[str] = field(default_factory=list)
    keys: list[str] | None = None  # JSON keys of the tables, when document is None


def _stdout_console() -> Console:
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200,
                   highlight=False)


def clean(value: Any) -> Any:
    """JSON-safe: NaN/inf → null, nested containers cleaned, keys as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return "—" if not math.isfinite(value) else f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(clean(value))
    return str(value)


def rich_table(title: str, df: pl.DataFrame) -> RichTable:
    from rich.table import Table

    t = Table(title=title or None, title_justify="left", box=None, pad_edge=False,
              title_style="bold")
    for name, dtype in zip(df.columns, df.dtypes):
        numeric = dtype.is_numeric()
        t.add_column(name, justify="right" if numeric else "left", overflow="fold")
    for row in df.iter_rows():
        t.add_row(*[_cell(v) for v in row])
    return t


def emit(report: Report, fmt: str) -> None:
    if fmt == "json":
        doc = report.document
        if doc is None:
            keys = report.keys or [title for title, _ in report.tables]
            doc = {key: df.to_dicts() for key, (_, df) in zip(keys, report.tables)}
        sys.stdout.write(json.dumps(clean(doc), allow_nan=False) + "\n")
    elif fmt == "csv":
        if report.tables:
            df = report.tables[0][1]
            nested = [c for c, t in zip(df.columns, df.dtypes) if t.is_nested()]
            if nested:  # csv has no lists: write them as JSON text
                import polars as pl

                df = df.with_columns(pl.col(c).map_elements(
                    lambda v: json.dumps(clean(v.to_list() if hasattr(v, "to_list") else v)),
                    return_dtype=pl.String) for c in nested)
            sys.stdout.write(df.write_csv())
    else:
        console = _stdout_console()
        for i, (title, df) in enumerate(report.tables):
            if i:
                console.print()
            console.print(rich_table(title, df))
        for line in report.lines:
            console.print(line, markup=False)
    sys.stdout.flush()


def warn(message: str) -> None:
    from rich.markup import escape

    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)


def note(message: str) -> None:
    err_console.print(message, highlight=False, markup=False)
