from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.output import Format, Json, Report, emit, pick_format
from draco_cli.cli.options import (IN, OUT, BaseUrl, Force, MaxTokens, Model, Seed,
                                   StructuredOutput, Temperature, Timeout)

app = typer.Typer(help="The LLM layer: call logs and a connection check.", no_args_is_help=True)


@app.command("export")
def export(
    calls: Annotated[Path, typer.Option("--calls", parser=IN, help="Call log (llm_calls.sqlite).")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT, help="Parquet file to write.")],
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Export a call log as Parquet, to query with DuckDB or polars.

    Example: draco llm export --calls runs/step-3/llm_calls.sqlite -o calls.parquet
    """
    from draco_cli.llm.export import export_parquet

    chosen = pick_format(fmt, as_json)
    n = export_parquet(calls, out, force=force)
    if chosen == "table":
        err_console.print(f"wrote {n} calls → {out}", highlight=False)
    else:
        import polars as pl

        emit(Report([("export", pl.DataFrame([{"file": str(out), "calls": n}]))],
                    document={"file": str(out), "calls": n}), chosen)


@app.command("check")
def check(
    model: Model,
    base_url: BaseUrl = None,
    timeout: Timeout = 120.0,
    max_tokens: MaxTokens = 1024,
    temperature: Temperature = None,
    seed: Seed = None,
    structured_output: StructuredOutput = "auto",
    parallelism: Annotated[bool, typer.Option(
        "--parallelism/--no-parallelism", metavar="",
        help="Measure the server's useful parallelism (1, 2, 4, 8 requests at once).")] = True,
) -> None:
    """Probe a model setup with a few small judge-shaped requests, at the temperature, token
    limit and timeout the run will use: every structured-output form the server takes, whether
    it honours n, whether its chat format keeps the system role, its useful parallelism,
    tokens/s and context window; prints the options to run with, the whole line.

    Example: draco llm check --model openai/qwen --base-url http://localhost:8000/v1 --temperature 1
    """
    from draco_cli.llm.checks import run_check

    result = run_check(model, base_url, timeout, max_tokens=max_tokens, temperature=temperature,
                       seed=seed, form=structured_output, parallelism=parallelism)
    from rich.markup import escape

    for f in result.findings:
        mark = "[green]ok[/]" if f.ok else "[yellow]no[/]"
        err_console.print(f"  {mark} {f.what}: {escape(f.detail)}", highlight=False, markup=True)
    err_console.print(result.summary(), highlight=False)
    if result.advice:  # the command's result, on stdout and on one line, for a script to take
        typer.echo(f"use: {result.options()}")
    if not result.ok:
        raise typer.Exit(1)
