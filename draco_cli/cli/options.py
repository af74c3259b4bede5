"""Options shared by several commands, as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

Force = Annotated[bool, typer.Option("--force", help="Overwrite existing outputs.")]
OutDir = Annotated[Path, typer.Option("-o", "--out", help="Output folder.", show_default=False)]

# --- LLM stages -------------------------------------------------------------------------
Model = Annotated[str, typer.Option(
    "--model", help="provider/model: openai/gpt-4.1, anthropic/claude-sonnet-4-5, openai/NAME "
    "with --base-url for a vLLM/SGLang/Ollama server, or replay/PATH to answer from a recorded "
    "call log. Keys come from OPENAI_API_KEY / ANTHROPIC_API_KEY.")]
BaseUrl = Annotated[Optional[str], typer.Option(
    "--base-url", envvar="DRACO_BASE_URL",
    help="Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1.")]
Concurrency = Annotated[int, typer.Option(min=1, help="Calls in flight at once.")]
Rpm = Annotated[Optional[float], typer.Option(help="Requests per minute limit.")]
Tpm = Annotated[Optional[float], typer.Option(help="Tokens per minute limit (estimated).")]
Timeout = Annotated[float, typer.Option(help="Seconds per call before it is retried.")]
ParseRetries = Annotated[int, typer.Option(
    min=0, help="Re-asks after an answer that does not validate, then unanswered.")]
MaxCost = Annotated[Optional[float], typer.Option(
    help="Stop issuing calls once this many USD are spent; rerun to resume.")]
Prices = Annotated[Optional[Path], typer.Option(
    help="Price table JSON overriding the shipped one (USD per million tokens).")]
Batch = Annotated[bool, typer.Option(
    "--batch", help="Use the provider's batch API (half price, hours); resumable.")]
