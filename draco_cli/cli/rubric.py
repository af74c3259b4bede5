from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from draco_cli.cli import llmrun
from draco_cli.cli.console import err_console
from draco_cli.cli.options import folder_path
from draco_cli.cli.options import RUBRIC_PANEL
from draco_cli.cli.options import (Adapt, Seed, StructuredOutput, SystemRole, Temperature, UseN,
                                   BaseUrls, Batch, CallLogPath, Concurrency, Force, MaxCost,
                                   MaxPromptTokens, MaxTokens, Model, NoDefaultRedact,
                                   ParseRetries, Prices, Redact, Rpm, ShowPrompt, Thinking,
                                   Timeout, Tpm)

app = typer.Typer(help="Rubrics: dynamic (written by an LLM per group) or static.",
                  no_args_is_help=True)

RolloutsOpt = Annotated[Path, typer.Option("--rollouts", help="rollouts.parquet.")]
StepsOpt = Annotated[Path, typer.Option("--steps", help="steps.parquet.")]
OutOpt = Annotated[Path, typer.Option("-o", "--out", help="Output folder.", callback=folder_path)]


@app.command("generate")
def generate(
    rollouts: RolloutsOpt, steps: StepsOpt, out: OutOpt, model: Model,
    max_criteria: Annotated[int, typer.Option(min=1, help="Criteria per group after merge.",
        rich_help_panel=RUBRIC_PANEL)] = 8,
    stages: Annotated[str, typer.Option(help="Comma-separated stages to run.",
        rich_help_panel=RUBRIC_PANEL)]
    = "generate,union,merge",
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
    """Write rubrics for each group: criteria per rollout (generate), per group (union), merged
    and capped (merge) → OUT/rubric_candidates.parquet, OUT/rubrics.parquet.

    Example: draco rubric generate --rollouts d/rollouts.parquet --steps d/steps.parquet --model openai/gpt-4.1 -o d/rubric
    """
    from draco_cli.ops.llmstage import render_options
    from draco_cli.ops.rubric import rubric_generate, rubric_prompt

    render = render_options(max_prompt_tokens, redact or [], no_default_redact)
    stage_list = tuple(x.strip() for x in stages.split(",") if x.strip())
    if show_prompt:
        if stage_list[0] not in ("generate", "union"):
            raise typer.BadParameter(
                "--show-prompt shows the generate or union prompt (the first of --stages); the "
                "merge prompt lists their candidates, which exist only after they ran",
                param_hint="--stages")
        typer.echo(rubric_prompt(rollouts, steps, stage_list[0], max_criteria=max_criteria,
                                 render=render))
        return
    s = llmrun.settings(
        model=model, base_url=base_url, concurrency=concurrency, rpm=rpm, tpm=tpm,
        timeout=timeout, parse_retries=parse_retries, max_cost=max_cost, prices=prices,
        batch=batch, thinking=thinking, structured_output=structured_output,
        system_role=system_role, use_n=use_n, temperature=temperature, seed=seed, adapt=adapt)
    with llmrun.progress_bar("rubrics") as bar:
        report = rubric_generate(rollouts, steps, out, s, stages=stage_list,
                                 max_criteria=max_criteria, render=render,
                                 max_tokens=max_tokens, call_log=call_log, force=force,
                                 progress=bar)
    llmrun.print_report(report)


@app.command("static")
def static(
    rollouts: RolloutsOpt, out: OutOpt,
    rubric: Annotated[Optional[Path], typer.Option(
        "--rubric", help="YAML, JSON or Parquet criteria (title, requirement); default: "
        "draco's own rubric (secrets, pagination, stopping, errors, dates, confirmation).")]
    = None,
    force: Force = False,
) -> None:
    """Apply one fixed rubric to every group → OUT/rubrics.parquet.

    Example: draco rubric static --rollouts d/rollouts.parquet -o d/rubric
    """
    from draco_cli.ops.rubric import rubric_static

    n, groups, target = rubric_static(rollouts, rubric, out, force=force)
    err_console.print(f"{n} criteria applied to {groups} groups → {target}", highlight=False)
