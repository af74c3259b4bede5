from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.credit import Drop, DropOpt, JudgeOpt, RolloutsOpt, VerdictsOpt
from draco_cli.cli.options import Force

app = typer.Typer(help="Judging rollouts against rubrics.", no_args_is_help=True)


@app.command("filter")
def filter_(
    rollouts: RolloutsOpt,
    verdicts: VerdictsOpt,
    out: Annotated[Path, typer.Option("-o", "--out", help="Output file (- for stdout).")],
    drop: DropOpt = Drop.all_pass,
    judge: JudgeOpt = None,
    force: Force = False,
) -> None:
    """Add `retained` to aggregated verdicts: a criterion is kept iff some member of its group
    failed it (the discriminative filter).

    Example: draco judge filter --rollouts run/rollouts.parquet --verdicts run/verdicts.parquet -o run/verdicts.filtered.parquet
    """
    from draco_cli.pipeline import judge_filter

    kept, total = judge_filter(rollouts, verdicts, out, drop=drop.value, judge=judge, force=force)
    err_console.print(f"kept {kept} of {total} (group, criterion) pairs → {out}", highlight=False)
