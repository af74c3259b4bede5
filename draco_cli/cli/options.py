"""Options shared by several commands, as Annotated aliases.

Each option belongs to the help panel of the library's option object it fills (one typer option
group per object): LLM options → ``LLMSettings``, prompt options → ``PromptOptions``, rubric,
judge and credit options → ``RubricOptions``, ``JudgeOptions``, ``CreditOptions``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

LLM_PANEL = "LLM options"
PROMPT_PANEL = "Prompt options"
RUBRIC_PANEL = "Rubric options"
JUDGE_PANEL = "Judge options"
CREDIT_PANEL = "Credit options"


def folder_path(value: Path | None) -> Path | None:
    """A folder option: ``-`` (stdout) cannot hold a folder; say so before any work."""
    if value is not None and str(value) == "-":
        raise typer.BadParameter("- is stdout, which cannot hold a folder: give a folder path")
    return value


Force = Annotated[bool, typer.Option("--force", help="Overwrite existing outputs.")]
OutDir = Annotated[Path, typer.Option("-o", "--out", help="Output folder.", show_default=False,
                                      callback=folder_path)]

# --- LLM stages -------------------------------------------------------------------------
Model = Annotated[str, typer.Option(
    "--model", help="provider/model: openai/gpt-4.1, anthropic/claude-sonnet-4-5, openai/NAME "
    "with --base-url for a vLLM/SGLang/Ollama server, or replay/PATH to answer from a recorded "
    "call log. Keys come from OPENAI_API_KEY / ANTHROPIC_API_KEY.", rich_help_panel=LLM_PANEL)]
BaseUrl = Annotated[Optional[str], typer.Option(
    "--base-url", envvar="DRACO_BASE_URL",
    help="Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1.",
        rich_help_panel=LLM_PANEL)]
BaseUrls = Annotated[Optional[list[str]], typer.Option(
    "--base-url", envvar="DRACO_BASE_URL",
    help="Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1. Repeat it (or "
    "give a file listing one URL a line) for a fleet serving one model: calls go to the endpoint "
    "with the fewest in flight, a failing one is backed off and the call retried on another.",
        rich_help_panel=LLM_PANEL)]
Concurrency = Annotated[int, typer.Option(
    min=1, help="Most calls in flight at once; with --adapt draco keeps fewer when the server "
    "does not serve more in parallel.", rich_help_panel=LLM_PANEL)]
Adapt = Annotated[Optional[bool], typer.Option(
    "--adapt/--no-adapt", help="Measure the server's useful parallelism and keep in-flight "
    "calls near it (--no-adapt: always --concurrency). Default: on with --base-url.",
        rich_help_panel=LLM_PANEL)]
Rpm = Annotated[Optional[float], typer.Option(help="Requests per minute limit.",
    rich_help_panel=LLM_PANEL)]
Tpm = Annotated[Optional[float], typer.Option(help="Tokens per minute limit (estimated).",
    rich_help_panel=LLM_PANEL)]
Timeout = Annotated[float, typer.Option(help="Seconds per call before it is retried.",
    rich_help_panel=LLM_PANEL)]
ParseRetries = Annotated[int, typer.Option(
    min=0, help="Re-asks after an answer that does not validate, then unanswered.",
        rich_help_panel=LLM_PANEL)]
MaxCost = Annotated[Optional[float], typer.Option(
    help="Stop issuing calls once this many USD are spent; rerun to resume.",
        rich_help_panel=LLM_PANEL)]
Prices = Annotated[Optional[Path], typer.Option(
    help="Price table JSON overriding the shipped one (USD per million tokens).",
        rich_help_panel=LLM_PANEL)]
Batch = Annotated[Optional[bool], typer.Option(
    "--batch/--no-batch", help="The provider's batch API (half price, answers within hours; "
    "resumable). Default: on for openai/ and anthropic/ hosted APIs, off with --base-url "
    "(self-hosted servers rarely have one).", rich_help_panel=LLM_PANEL)]
Thinking = Annotated[Literal["on", "off"], typer.Option(
    help="on|off: thinking for the judge model (reasoning effort, extended thinking, or Qwen3's "
    "enable_thinking on vLLM/SGLang).", rich_help_panel=LLM_PANEL)]
MaxTokens = Annotated[int, typer.Option(min=16, help="Token limit per answer.",
    rich_help_panel=PROMPT_PANEL)]
MaxPromptTokens = Annotated[int, typer.Option(
    min=500, help="Prompt budget: long observations are shortened in the middle to fit.",
        rich_help_panel=PROMPT_PANEL)]
Redact = Annotated[Optional[list[str]], typer.Option(
    help="Regex of text to mask before it leaves the machine (repeatable); API keys, bearer "
    "tokens and passwords are masked by default.", rich_help_panel=PROMPT_PANEL)]
NoDefaultRedact = Annotated[bool, typer.Option(
    "--no-default-redact", help="Mask only the --redact patterns.", rich_help_panel=PROMPT_PANEL)]
CallLogPath = Annotated[Optional[Path], typer.Option(
    "--call-log", help="Call log to use (default OUT/llm_calls.sqlite); reruns resume from it.",
        rich_help_panel=LLM_PANEL)]
ShowPrompt = Annotated[bool, typer.Option(
    "--show-prompt", help="Print the rendered prompt for the first rollout and exit; no call.",
        rich_help_panel=PROMPT_PANEL)]
StructuredOutput = Annotated[str, typer.Option(
    help="How answers are constrained to JSON: auto, json-schema (OpenAI strict), "
    "json-schema-loose (strict false; SGLang, Ollama), json-object (llama.cpp), vllm "
    "(structured_outputs, vLLM >= 0.12), prompt (schema in the prompt, validated and re-asked), "
    "output-format or tool (Anthropic). `draco llm check` says which one a server takes.",
        rich_help_panel=LLM_PANEL)]
SystemRole = Annotated[str, typer.Option(
    help="keep: instructions in the system role; fold: into the first user message (chat "
    "formats that drop system messages, e.g. Gemma).", rich_help_panel=LLM_PANEL)]
UseN = Annotated[bool, typer.Option(
    "--use-n/--no-use-n", help="Ask k samples in one request with n (servers that ignore n "
    "get the missing samples re-asked one per call either way).", rich_help_panel=LLM_PANEL)]
Temperature = Annotated[Optional[float], typer.Option(
    min=0.0, help="Sampling temperature (default: the server's).", rich_help_panel=LLM_PANEL)]
Seed = Annotated[Optional[int], typer.Option(
    help="Sampling seed, where the server honours one (enters the cache key).",
        rich_help_panel=LLM_PANEL)]
