from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from draco_cli.cli import llmrun
from draco_cli.cli.console import err_console
from draco_cli.cli.options import (IN, CallLogPath, Force, ShowPrompt, OutDir, Rollouts, Steps,
                                   llm_options, prompt_options, rubric_options)

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.options import PromptOptions, RubricOptions

app = typer.Typer(help="Rubrics: dynamic (written by an LLM per group) or static.",
                  no_args_is_help=True)



@app.command("generate")
@llm_options()
@prompt_options()
@rubric_options("max_criteria", "stages", "candidates")
def generate(
    rollouts: Rollouts, steps: Steps, out: OutDir,
    llm: LLMSettings, prompt: PromptOptions, rubric: RubricOptions,
    call_log: CallLogPath = None, show_prompt: ShowPrompt = False, force: Force = False,
) -> None:
    """Write rubrics for each group: criteria per rollout (generate), per group (union), merged
    and capped (merge) → OUT/rubric_candidates.parquet, OUT/rubrics.parquet.

    Example: draco rubric generate --rollouts d/rollouts.parquet --steps d/steps.parquet --model openai/gpt-4.1 -o d/rubric
    """
    from draco_cli.llm.stage import render_options
    from draco_cli.rubric.stage import rubric_generate, rubric_prompt

    render = render_options(prompt)
    if show_prompt:
        if rubric.stages[0] not in ("generate", "union"):
            raise typer.BadParameter(
                "--show-prompt shows the generate or union prompt (the first of --stages); the "
                "merge prompt lists their candidates, which exist only after they ran",
                param_hint="--stages")
        typer.echo(rubric_prompt(rollouts, steps, rubric.stages[0],
                                 max_criteria=rubric.max_criteria, render=render))
        return
    with llmrun.progress_bar("rubrics") as bar:
        llmrun.announce_batch(llm)
        report = rubric_generate(rollouts, steps, out, llm, stages=rubric.stages,
                                 max_criteria=rubric.max_criteria, render=render,
                                 max_tokens=prompt.max_tokens, call_log=call_log, force=force,
                                 progress=bar, candidates=rubric.candidates)
    llmrun.print_report(report)


@app.command("static")
def static(
    rollouts: Rollouts, out: OutDir,
    rubric: Annotated[Path | None, typer.Option(
        "--rubric", parser=IN, help="YAML, JSON or Parquet criteria (title, requirement); default: "
        "draco's own rubric (secrets, pagination, stopping, errors, dates, confirmation).")]
    = None,
    force: Force = False,
) -> None:
    """Apply one fixed rubric to every group → OUT/rubrics.parquet.

    Example: draco rubric static --rollouts d/rollouts.parquet -o d/rubric
    """
    from draco_cli.rubric.stage import rubric_static

    n, groups, target = rubric_static(rollouts, rubric, out, force=force)
    err_console.print(f"{n} criteria applied to {groups} groups → {target}", highlight=False)
