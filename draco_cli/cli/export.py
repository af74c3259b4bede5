from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import IN, OUT, Force


def export(
    to: Annotated[str, typer.Option("--to", help="The RL stack whose layout to write: "
                                    "verifiers, rllm, skyrl or slime.")],
    advantages: Annotated[Path, typer.Option(
        "--advantages", parser=IN,
        help="A run folder, or its credit/token_advantages.parquet.")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT, help="File to write.")],
    records: Annotated[Path | None, typer.Option(
        "--records", parser=IN, help="The stack's own rollout records to fill in, where its "
        "layout needs them.")] = None,
    force: Force = False,
) -> None:
    """Export a run's token advantages in another RL stack's own layout, self-checking.

    Example: draco export --to verifiers --advantages runs/step-3 --records traces.jsonl -o
    scored/traces.jsonl
    """
    from draco_cli.trainers.export import export_advantages

    res = export_advantages(advantages, to, out, records=records, force=force)
    err_console.print(f"wrote {res.rollouts} rollouts, {res.tokens} tokens → {res.path}",
                      highlight=False)
    for note in res.notes:
        err_console.print(f"  - {note}", highlight=False)
