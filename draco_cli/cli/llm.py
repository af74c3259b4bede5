from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.output import Format, Json, Report, emit, pick_format
from draco_cli.cli.options import BaseUrl, Force, Model, Timeout

app = typer.Typer(help="The LLM layer: call logs and a connection check.", no_args_is_help=True)


@app.command("export")
def export(
    calls: Annotated[Path, typer.Option("--calls", help="Call log (llm_calls.sqlite).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Parquet file to write.")],
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Export a call log as Parquet, to query with DuckDB or polars.

    Example: draco llm export --calls runs/step-3/llm_calls.sqlite -o calls.parquet
    """
    from draco_cli.llm.calllog import export_parquet

    fmt = pick_format(fmt, as_json)
    n = export_parquet(calls, out, force=force)
    if fmt == "table":
        err_console.print(f"wrote {n} calls → {out}", highlight=False)
    else:
        import polars as pl

        emit(Report([("export", pl.DataFrame([{"file": str(out), "calls": n}]))],
                    document={"file": str(out), "calls": n}), fmt)


@app.command("check")
def check(
    model: Model,
    base_url: BaseUrl = None,
    timeout: Timeout = 60.0,
) -> None:
    """Send one small structured-output request and report whether the answer validated,
    with its latency, tokens and cost: a cheap test of keys, URL and JSON-schema support.

    Example: draco llm check --model openai/Qwen3-8B --base-url http://localhost:8000/v1
    """
    import tempfile

    from draco_cli.llm.checks import run_check

    with tempfile.TemporaryDirectory() as tmp:
        result = run_check(model, base_url, timeout, Path(tmp) / "check.sqlite")
    err_console.print(result.summary(), highlight=False)
    if not result.ok:
        raise typer.Exit(1)
