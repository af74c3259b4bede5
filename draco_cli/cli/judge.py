from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from draco_cli.cli import llmrun
from draco_cli.cli.console import err_console
from draco_cli.cli.credit import Drop, DropOpt, JudgeOpt, RolloutsOpt
from draco_cli.cli.options import folder_path
from draco_cli.cli.options import JUDGE_PANEL
from draco_cli.cli.options import (Adapt, Seed, StructuredOutput, SystemRole, Temperature, UseN,
                                   BaseUrls, Batch, CallLogPath, Concurrency, Force, MaxCost,
                                   MaxPromptTokens, MaxTokens, Model, NoDefaultRedact,
                                   ParseRetries, Prices, Redact, Rpm, ShowPrompt, Thinking,
                                   Timeout, Tpm)

app = typer.Typer(help="Judging rollouts against rubrics.", no_args_is_help=True)


@app.command("filter")
def filter_(
    rollouts: RolloutsOpt,
    verdicts: Annotated[Path, typer.Option("--verdicts", help="Aggregated verdicts.parquet.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output file (- for stdout).")],
    drop: DropOpt = Drop.all_pass,
    judge: JudgeOpt = None,
    force: Force = False,
) -> None:
    """Add `retained` to aggregated verdicts: a criterion is kept iff some member of its group
    failed it (the discriminative filter).

    Example: draco judge filter --rollouts run/rollouts.parquet --verdicts run/verdicts.parquet -o run/verdicts.filtered.parquet
    """
    from draco_cli.ops.judge import judge_filter

    kept, total = judge_filter(rollouts, verdicts, out, drop=drop.value, judge=judge, force=force)
    err_console.print(f"kept {kept} of {total} (group, criterion) pairs → {out}", highlight=False)


@app.command("score")
def score(
    rollouts: Annotated[Path, typer.Option("--rollouts", help="rollouts.parquet.")],
    steps: Annotated[Path, typer.Option("--steps", help="steps.parquet.")],
    rubrics: Annotated[Path, typer.Option("--rubrics", help="rubrics.parquet.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder.", callback=folder_path)],
    model: Model,
    samples: Annotated[int, typer.Option(min=1, help="Judge samples per rollout (k).",
        rich_help_panel=JUDGE_PANEL)] = 1,
    aggregate: Annotated[Optional[Literal["all", "majority"]], typer.Option(
        help="all (fail if any sample fails, pass only if all pass; default for k > 1) or "
        "majority.", rich_help_panel=JUDGE_PANEL)] = None,
    judge_label: Annotated[str, typer.Option(help="Judge arm label stored with the verdicts.",
        rich_help_panel=JUDGE_PANEL)]
    = "judge",
    base_url: BaseUrls = None, concurrency: Concurrency = 16, rpm: Rpm = None, tpm: Tpm = None,
    timeout: Timeout = 120.0, parse_retries: ParseRetries = 2, max_cost: MaxCost = None,
    prices: Prices = None, batch: Batch = None, thinking: Thinking = "off",
    max_tokens: MaxTokens = 4096, max_prompt_tokens: MaxPromptTokens = 24000,
    redact: Redact = None, no_default_redact: NoDefaultRedact = False,
    call_log: CallLogPath = None, show_prompt: ShowPrompt = False, force: Force = False,
    structured_output: StructuredOutput = "auto", system_role: SystemRole = "keep",
    use_n: UseN = True, temperature: Temperature = None, seed: Seed = None,
    adapt: Adapt = None,
) -> None:
    """Score every rollout against its group's rubric, citing steps → OUT/verdicts_raw.parquet
    (one row per sample) and OUT/verdicts.parquet (aggregated).

    Example: draco judge score --rollouts d/rollouts.parquet --steps d/steps.parquet --rubrics d/rubric/rubrics.parquet --model openai/gpt-4.1 -o d/judge
    """
    from draco_cli.ops.judge import judge_prompt, judge_score
    from draco_cli.ops.llmstage import render_options

    render = render_options(max_prompt_tokens, redact or [], no_default_redact)
    if show_prompt:
        typer.echo(judge_prompt(rollouts, steps, rubrics, render=render, samples=samples))
        return
    s = llmrun.settings(
        model=model, base_url=base_url, concurrency=concurrency, rpm=rpm, tpm=tpm,
        timeout=timeout, parse_retries=parse_retries, max_cost=max_cost, prices=prices,
        batch=batch, thinking=thinking, structured_output=structured_output,
        system_role=system_role, use_n=use_n, temperature=temperature, seed=seed, adapt=adapt)
    with llmrun.progress_bar("judging") as bar:
        report = judge_score(rollouts, steps, rubrics, out, s, samples=samples,
                             aggregate=aggregate or "all", judge_label=judge_label,
                             render=render, max_tokens=max_tokens, call_log=call_log,
                             force=force, progress=bar)
    llmrun.print_report(report)
