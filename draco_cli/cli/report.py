from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import IN, OUT, Force
from draco_cli.errors import UsageError


def report(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN_DIR...", parser=IN,
                                               help="Run folders written "
                                               "by draco run (several: one per training step).")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT, help="HTML file to write.")],
    rollout: Annotated[str | None, typer.Option(
        help="Rollout to open first in the step-credit view (default: the largest "
        "|advantage|).")] = None,
    force: Force = False,
) -> None:
    """One self-contained HTML report: a health banner, per-step summary with the rubric
    reward's agreement with the environment outcome, a credit heatmap with every step's judge
    reasons, criteria pass rates, trends over training steps, unanswered shares and cost.

    Example: draco report runs/step-0 runs/step-1 -o report.html
    """
    from draco_cli.io import check_writable, write_text_atomic
    from draco_cli.report import build_report

    if str(out) == "-" or out.is_dir():
        raise UsageError(f"-o {out}: give an HTML file to write, e.g. {out}/report.html"
                         if str(out) != "-" else "-o -: give an HTML file to write")
    check_writable(out, force)
    write_text_atomic(out, build_report(runs, rollout), force=force)
    err_console.print(f"wrote {out}", highlight=False)
