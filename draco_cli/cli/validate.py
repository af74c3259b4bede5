from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from draco_cli.cli.console import err_console


def validate(
    paths: Annotated[
        list[Path],
        typer.Argument(metavar="PATH...", help="Parquet tables, folders of them, or - for an "
                       "Arrow IPC stream on stdin."),
    ],
    table: Annotated[Optional[str], typer.Option(
        "--table", help="Which table - (stdin) holds, e.g. verdicts: needed for a stream "
        "draco did not write.")] = None,
) -> None:
    """Check tables against their contracts and each other; exit 1 listing every problem.

    Example: draco validate data/step-0
    """
    from draco_cli.errors import ValidationFailed
    from draco_cli.validate import validate_paths

    from draco_cli.runfolder import RunFolder
    if table is not None:
        from draco_cli.io import name_stdin_table
        from draco_cli.schemas import TABLES

        if table not in TABLES:
            raise typer.BadParameter(f"{table!r}: choose {', '.join(sorted(TABLES))}",
                                     param_hint="--table")
        name_stdin_table(table)

    files: list[Path] = []
    for p in paths:
        if str(p) != "-" and p.is_dir() and RunFolder.is_run_folder(p):
            files += RunFolder.open(p).table_files()  # a draco run: its inputs and stages
            continue
        files += sorted(p.glob("*.parquet")) if str(p) != "-" and p.is_dir() else [p]
    counts, problems = validate_paths(files)
    if problems:
        raise ValidationFailed(problems)
    summary = ", ".join(f"{n} {t}" for t, n in counts.items())
    err_console.print(f"[green]ok[/]: {summary or 'no tables found'}", highlight=False)
    if not counts:
        raise typer.Exit(1)
