from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import IN


def validate(
    paths: Annotated[
        list[Path],
        typer.Argument(metavar="PATH...", help="Parquet tables (checked as one set), folders "
                       "(every folder below checked as its own set, e.g. a whole run folder), "
                       "or - for an Arrow IPC stream on stdin.", parser=IN),
    ],
    table: Annotated[str | None, typer.Option(
        "--table", help="Which table - (stdin) holds, e.g. verdicts: needed for a stream "
        "draco did not write.")] = None,
) -> None:
    """Check tables and manifests against their contracts and each other; exit 1 listing
    every problem.

    Example: draco validate data/step-0 runs/step-0
    """
    from draco_cli.errors import ValidationFailed
    from draco_cli.validate import validate_targets

    if table is not None:
        from draco_cli.schemas import TABLES

        if table not in TABLES:
            raise typer.BadParameter(f"{table!r}: choose {', '.join(sorted(TABLES))}",
                                     param_hint="--table")

    sets, problems = validate_targets(paths, stdin_table=table)
    if problems:
        raise ValidationFailed(problems)
    for label, counts in sets:
        summary = ", ".join(f"{n} {t}" for t, n in counts.items()) or "manifest only"
        err_console.print(f"[green]ok[/] {label}: {summary}", highlight=False, soft_wrap=True)
