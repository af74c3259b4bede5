from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.choices import CodeBlocks, IngestFormat, StepUnit
from draco_cli.cli.options import IN, Force, OutDir


def ingest(
    fmt: Annotated[IngestFormat, typer.Argument(metavar="FORMAT", help="Log format of the inputs.")],
    inputs: Annotated[list[Path], typer.Argument(metavar="INPUT...", parser=IN, help="Log files.")],
    out: OutDir,
    step_unit: Annotated[
        StepUnit, typer.Option(help="What one step is: an assistant message, a fenced code "
                               "block the environment ran, or one tool call.")
    ] = "message",
    code_language: Annotated[
        str, typer.Option(help="code-block unit: the language of the blocks the harness "
                          "runs (comma-separated, or 'any'); mini-swe-agent runs bash, "
                          "AppWorld python.")
    ] = "bash",
    code_blocks: Annotated[
        CodeBlocks, typer.Option(help="code-block unit: 'one' = a message runs its block "
                                 "only when it holds exactly one (mini-swe-agent); 'all' = "
                                 "every block runs.")
    ] = "one",
    tokenizer: Annotated[
        str | None,
        typer.Option(help="tokenizer.json of the trainer's model, for logs without token "
                     "counts; 'approx' = ceil(chars/4), an approximation."),
    ] = None,
    group_by: Annotated[
        str | None,
        typer.Option(help="Comma-separated rollout fields forming group_id "
                     "(default: task_id, plus train_step when set)."),
    ] = None,
    train_step: Annotated[
        int | None, typer.Option(help="train_step for rollouts whose log does not say.")
    ] = None,
    skip_invalid: Annotated[
        bool, typer.Option(metavar="", help="Write bad entries to OUT/rejects.jsonl and go on.")
    ] = False,
    force: Force = False,
) -> None:
    """Ingest agent logs into OUT/rollouts.parquet, OUT/steps.parquet and OUT/manifest.json
    (agentprocessbench: and its human step labels into OUT/step_labels.parquet).

    Example: draco ingest tau-bench results.json --tokenizer approx -o data/step-0
    """
    from draco_cli.ingest import ingest_logs

    with err_console.status("ingesting…"):
        result = ingest_logs(fmt, list(inputs), out, step_unit=step_unit,
                             tokenizer=tokenizer, group_by=group_by, train_step=train_step,
                             skip_invalid=skip_invalid, force=force,
                             code_language=code_language, code_blocks=code_blocks)
    m = result.manifest
    err_console.print(
        f"[green]ingested[/] {m['rollouts']} rollouts in {m['groups']} groups, {m['steps']} "
        f"steps (unit: {m['step_unit']}; tokens: {', '.join(m['token_counts']) or 'none'}"
        f"{'' if m['tokenizer'] is None else ' via ' + m['tokenizer']}; positions "
        f"{m['token_positions']})"
        + (f", {m['step_labels']} step labels" if "step_labels" in m else "") + f" → {out}",
        highlight=False,
    )
    if m["tokenizer_exact"] is False:
        err_console.print("[yellow]note:[/] token counts are approximate (--tokenizer approx)")
    for warning in result.warnings:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if result.rejected:
        err_console.print(f"[yellow]rejected[/] {result.rejected} entries → {out}/rejects.jsonl")
