from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import Force


def report(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN_DIR...", help="Run folders written "
                                               "by draco run (several: one per training step).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="HTML file to write.")],
    rollout: Annotated[Optional[str], typer.Option(help="Rollout to show step by step "
                                                   "(default: the largest |advantage|).")] = None,
    force: Force = False,
) -> None:
    """One self-contained HTML report: reward and advantage distributions, one rollout's steps
    coloured by credit with the criteria citing them, criteria kept and dropped, trends over
    training steps, cost per phase.

    Example: draco report runs/step-0 runs/step-1 -o report.html
    """
    from draco_cli.io import write_text_atomic
    from draco_cli.report import build_report

    write_text_atomic(out, build_report(runs, rollout), force=force)
    err_console.print(f"wrote {out}", highlight=False)
