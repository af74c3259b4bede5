from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from draco_cli.cli import llmrun
from draco_cli.cli.console import err_console
from draco_cli.cli.credit import DropOpt, JudgeOpt, RolloutsOpt
from draco_cli.cli.options import (IN, OUT, CallLogPath, Force, ShowPrompt, OutDir, Rollouts,
                                   Steps, judge_options, llm_options, prompt_options)

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.options import JudgeOptions, PromptOptions

app = typer.Typer(help="Judging rollouts against rubrics.", no_args_is_help=True)


@app.command("filter")
def filter_(
    rollouts: RolloutsOpt,
    verdicts: Annotated[Path, typer.Option("--verdicts", parser=IN,
                                           help="Aggregated verdicts.parquet.")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT,
                                      help="Output file (- for stdout).")],
    drop: DropOpt = "all-pass",
    judge: JudgeOpt = None,
    force: Force = False,
) -> None:
    """Add `retained` to aggregated verdicts: a criterion is kept iff some member of its group
    failed it (the discriminative filter).

    Example: draco judge filter --rollouts run/rollouts.parquet --verdicts run/verdicts.parquet -o run/verdicts.filtered.parquet
    """
    from draco_cli.judge.stage import judge_filter

    kept, total = judge_filter(rollouts, verdicts, out, drop=drop, judge=judge, force=force)
    err_console.print(f"kept {kept} of {total} (group, criterion) pairs → {out}", highlight=False)


@app.command("score")
@llm_options()
@prompt_options()
@judge_options("samples", "aggregate", "judge_label")
def score(
    rollouts: Rollouts,
    steps: Steps,
    rubrics: Annotated[Path, typer.Option("--rubrics", parser=IN, help="rubrics.parquet.")],
    out: OutDir,
    llm: LLMSettings, prompt: PromptOptions, judge: JudgeOptions,
    call_log: CallLogPath = None, show_prompt: ShowPrompt = False, force: Force = False,
) -> None:
    """Score every rollout against its group's rubric, citing steps → OUT/verdicts_raw.parquet
    (one row per sample) and OUT/verdicts.parquet (aggregated).

    Example: draco judge score --rollouts d/rollouts.parquet --steps d/steps.parquet --rubrics d/rubric/rubrics.parquet --model openai/gpt-4.1 -o d/judge
    """
    from draco_cli.judge.stage import judge_prompt, judge_score
    from draco_cli.llm.settings import check_samples
    from draco_cli.llm.stage import render_options

    render = render_options(prompt)
    if show_prompt:
        typer.echo(judge_prompt(rollouts, steps, rubrics, render=render, samples=judge.samples))
        return
    check_samples(judge.samples, llm.temperature, llm.use_n)
    with llmrun.progress_bar("judging") as bar:
        llmrun.announce_batch(llm)
        report = judge_score(rollouts, steps, rubrics, out, llm, samples=judge.samples,
                             aggregate=judge.aggregate, judge_label=judge.judge_label,
                             render=render, max_tokens=prompt.max_tokens, call_log=call_log,
                             force=force, progress=bar)
    llmrun.print_report(report)
