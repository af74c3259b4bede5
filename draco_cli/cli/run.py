from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from draco_cli.cli import llmrun
from draco_cli.cli.console import err_console
from draco_cli.cli.options import (Adapt, Seed, StructuredOutput, SystemRole, Temperature, UseN,
                                   BaseUrl, Batch, Concurrency, MaxCost, MaxPromptTokens,
                                   MaxTokens, Model, ParseRetries, Prices, Redact, Rpm,
                                   Thinking, Timeout, Tpm)


def run(
    rollouts: Annotated[Path, typer.Option("--rollouts", help="rollouts.parquet.")],
    steps: Annotated[Path, typer.Option("--steps", help="steps.parquet.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Run folder (or RUN_ROOT with "
                                      "--train-step: RUN_ROOT/step-N).")],
    model: Model,
    setting: Annotated[str, typer.Option(help="draco (dynamic rubrics + step credit), "
                                         "no-credit, static, static-no-credit.")] = "draco",
    judge_model: Annotated[Optional[str], typer.Option(help="Judge model, if not --model.")]
    = None,
    samples: Annotated[int, typer.Option(min=1, help="Judge samples per rollout.")] = 1,
    aggregate: Annotated[str, typer.Option(help="all or majority.")] = "all",
    judge_label: Annotated[str, typer.Option(help="Judge arm label.")] = "judge",
    max_criteria: Annotated[int, typer.Option(min=1)] = 8,
    static_rubric: Annotated[Optional[Path], typer.Option(
        help="Static rubric file for the static settings (default: draco's own).")] = None,
    train_step: Annotated[Optional[int], typer.Option(help="Write into OUT/step-N.")] = None,
    estimator: Annotated[str, typer.Option(help="grpo or rloo.")] = "grpo",
    std: Annotated[str, typer.Option(help="sample, population or none.")] = "sample",
    tokens: Annotated[str, typer.Option(help="spans, dense or both.")] = "spans",
    base_url: BaseUrl = None, concurrency: Concurrency = 16, rpm: Rpm = None, tpm: Tpm = None,
    timeout: Timeout = 120.0, parse_retries: ParseRetries = 2, max_cost: MaxCost = None,
    prices: Prices = None, batch: Batch = False, thinking: Thinking = "off",
    max_tokens: MaxTokens = 4096, max_prompt_tokens: MaxPromptTokens = 24000,
    redact: Redact = None,
    structured_output: StructuredOutput = "auto", system_role: SystemRole = "keep",
    use_n: UseN = True, temperature: Temperature = None, seed: Seed = None,
    adapt: Adapt = None,
) -> None:
    """One training step: rubric → judge → filter → credit, resumable and idempotent.

    Example: draco run --rollouts sample_data/appworld_mini/rollouts.parquet --steps sample_data/appworld_mini/steps.parquet --model replay/sample_data/llm_calls.sqlite -o runs/demo
    """
    from draco_cli.run import RunOptions, run_step

    llm = llmrun.settings(model, base_url, concurrency, rpm, tpm, timeout, parse_retries,
                          max_cost, prices, batch, thinking,
                        structured_output=structured_output, system_role=system_role,
                        use_n=use_n, temperature=temperature, seed=seed,
                        adapt=adapt)
    opts = RunOptions(setting=setting, judge_model=judge_model, samples=samples,
                      aggregate=aggregate, judge_label=judge_label, max_criteria=max_criteria,
                      static_rubric=str(static_rubric) if static_rubric else None,
                      estimator=estimator, std=std, tokens=tokens, max_tokens=max_tokens,
                      max_prompt_tokens=max_prompt_tokens, redact=redact or [])
    with llmrun.progress_bar("run") as bar:
        result = run_step(rollouts, steps, out, llm, opts, train_step, progress=bar)
    m = result.manifest
    calls = m["llm_calls"]
    total = sum(v.get("cost_usd") or 0 for v in calls.values())
    rows = sum(v.get("rows", 0) for v in calls.values())
    if result.skipped:
        err_console.print(f"unchanged, skipped: {', '.join(result.skipped)}", highlight=False)
    stats = m["stages"].get("credit", {}).get("stats", {})
    if stats:
        err_console.print(
            f"{stats['groups']} groups, {stats['rollouts']} rollouts; criteria kept "
            f"{stats['criteria_kept']} / dropped {stats['criteria_dropped']}; credit modes "
            f"{stats['credit_modes']}", highlight=False)
    unpriced = bool(calls) and all(v.get("cost_usd") is None for v in calls.values())
    money = "unpriced model" if unpriced else f"${total:.4f} in all"
    err_console.print(f"LLM calls logged: {rows} rows, {money}; "
                      f"{m['wall_seconds']:.1f} s", highlight=False)
    if result.budget_reached:
        err_console.print("[yellow]budget reached (--max-cost): rerun to resume[/]")
        raise typer.Exit(1)
    err_console.print(f"[green]token advantages:[/] {m['token_advantages']}", highlight=False)
