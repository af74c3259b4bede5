"""The command line's options, each declared once as an Annotated alias, and its option groups.

A group is a decorator: it adds its options to a command (in the help panel of the library
object they fill) and hands the command that object, built from them and so checked once,
before any work (a bad value: one line naming the option, exit 2). ``llm_options`` makes the
``LLMSettings``, ``prompt_options`` the ``PromptOptions``; a command may take a subset."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from draco_cli.choices import Aggregate
from draco_cli.storage import stage

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.options import PromptOptions

LLM_PANEL = "LLM options"
PROMPT_PANEL = "Prompt options"
RUBRIC_PANEL = "Rubric options"
JUDGE_PANEL = "Judge options"
CREDIT_PANEL = "Credit options"
SPOT_PANEL = "Spot-check options"

Command = Callable[..., None]
# an option in its group's help panel
llm_option = functools.partial(typer.Option, rich_help_panel=LLM_PANEL)
prompt_option = functools.partial(typer.Option, rich_help_panel=PROMPT_PANEL)
rubric_option = functools.partial(typer.Option, rich_help_panel=RUBRIC_PANEL)
judge_option = functools.partial(typer.Option, rich_help_panel=JUDGE_PANEL)
credit_option = functools.partial(typer.Option, rich_help_panel=CREDIT_PANEL)
spot_option = functools.partial(typer.Option, rich_help_panel=SPOT_PANEL)


# A path option's parser: a remote URI (s3://…) is fetched (IN), or pulled and published if the
# command succeeds (OUT: a file or folder; LOG: a call log, read and written); storage.stage
IN, OUT, LOG = ((lambda v, k=k: Path(stage(str(v), k))) for k in ("input", "output", "log"))


def folder_path(value: Path | None) -> Path | None:
    """A folder option: ``-`` (stdout) cannot hold a folder; say so before any work."""
    if value is not None and str(value) == "-":
        raise typer.BadParameter("- is stdout, which cannot hold a folder: give a folder path")
    return value


Force = Annotated[bool, typer.Option("--force", metavar="", help="Overwrite existing outputs.")]
Rollouts = Annotated[Path, typer.Option("--rollouts", parser=IN, help="rollouts.parquet.")]
Steps = Annotated[Path, typer.Option("--steps", parser=IN, help="steps.parquet.")]
OutDir = Annotated[Path, typer.Option("-o", "--out", help="Output folder.", show_default=False,
                                      callback=folder_path, parser=OUT)]

# --- LLM stages -------------------------------------------------------------------------
Model = Annotated[str, llm_option(
    "--model", help="provider/model: openai/gpt-4.1, anthropic/claude-sonnet-4-5, openai/NAME "
    "with --base-url for a vLLM/SGLang/Ollama server, or replay/PATH to answer from a recorded "
    "call log. Keys come from OPENAI_API_KEY / ANTHROPIC_API_KEY.")]
BaseUrl = Annotated[str | None, llm_option(
    "--base-url", envvar="DRACO_BASE_URL",
    help="Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1.")]
BaseUrls = Annotated[list[str] | None, llm_option(
    "--base-url", envvar="DRACO_BASE_URL",
    help="Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1. Repeat it (or "
    "give a file listing one URL a line) for a fleet serving one model: calls go to the endpoint "
    "with the fewest in flight, a failing one is backed off and the call retried on another.")]
Concurrency = Annotated[int, llm_option(
    min=1, help="Most calls in flight at once; with --adapt draco keeps fewer when the server "
    "does not serve more in parallel.")]
Adapt = Annotated[bool | None, llm_option(
    "--adapt/--no-adapt", metavar="",
    help="Measure the server's useful parallelism and keep in-flight "
    "calls near it (--no-adapt: always --concurrency). Default: on with --base-url.")]
Rpm = Annotated[float | None, llm_option(help="Requests per minute limit.")]
Tpm = Annotated[float | None, llm_option(help="Tokens per minute limit (estimated).")]
Timeout = Annotated[float, llm_option(help="Seconds per call before it is retried.")]
ParseRetries = Annotated[int, llm_option(
    min=0, help="Re-asks after an answer that does not validate, then unanswered.")]
MaxCost = Annotated[float | None, llm_option(
    help="Stop issuing calls once this many USD are spent; rerun to resume.")]
MaxReplyMib = Annotated[float, llm_option(
    "--max-reply-mib", help="Largest reply body a call takes, in MiB after decompression: a "
    "larger one (or a gzip bomb) is not read on, and that call ends unanswered with the reason.")]
Prices = Annotated[Path | None, llm_option(
    parser=IN, help="Price table JSON overriding the shipped one (USD per million tokens).")]
Batch = Annotated[bool | None, llm_option(
    "--batch/--no-batch", metavar="",
    help="The provider's batch API (half price, answers within hours; "
    "resumable). Default: off for draco run (a training step); for rubric generate and judge "
    "score on for openai/ and anthropic/ hosted APIs, off with --base-url (self-hosted "
    "servers rarely have one).")]
Thinking = Annotated[Literal["on", "off"], llm_option(
    help="on|off: thinking for the judge model (reasoning effort, extended thinking, or Qwen3's "
    "enable_thinking on vLLM/SGLang).")]
MaxTokens = Annotated[int, prompt_option(help="Token limit per answer (at least 16).")]
MaxPromptTokens = Annotated[int, prompt_option(
    help="Prompt budget, tokens (at least 500; estimated at 4 characters a token): the whole "
    "prompt — task context, task, steps and an allowance of 1200 for the instructions, criteria "
    "and schema; long observations are shortened in the middle to fit.")]
Redact = Annotated[list[str] | None, prompt_option(
    help="Regex of text to mask before it leaves the machine (repeatable); API keys, bearer "
    "tokens and passwords are masked by default.")]
NoDefaultRedact = Annotated[bool, prompt_option(
    "--no-default-redact", metavar="",
    help="Mask only the --redact patterns.")]
CallLogPath = Annotated[Path | None, llm_option(
    "--call-log", parser=LOG,
    help="Call log to use (default OUT/llm_calls.sqlite); reruns resume from it.")]
ShowPrompt = Annotated[bool, prompt_option(
    "--show-prompt", metavar="",
    help="Print the rendered prompt for the first rollout and exit; no call.")]
StructuredOutput = Annotated[str, llm_option(
    help="How answers are constrained to JSON: auto (prompt on the hosted OpenAI and Anthropic "
    "APIs, whose caches put a server-side schema first; json-schema with --base-url), "
    "json-schema (OpenAI strict), "
    "json-schema-loose (strict false; SGLang, Ollama), json-object (llama.cpp), vllm "
    "(structured_outputs, vLLM >= 0.12), prompt (schema in the prompt, validated and re-asked), "
    "output-format or tool (Anthropic). `draco llm check` says which one a server takes.")]
SystemRole = Annotated[Literal["keep", "fold"], llm_option(
    help="keep: instructions in the system role; fold: into the first user message (chat "
    "formats that drop system messages, e.g. Gemma).")]
UseN = Annotated[bool, llm_option(
    "--use-n/--no-use-n", metavar="",
    help="Ask k samples in one request with n (servers that ignore n "
    "get the missing samples re-asked one per call either way).")]
Temperature = Annotated[float | None, llm_option(
    min=0.0, help="Sampling temperature (default: the server's).")]
Seed = Annotated[int | None, llm_option(
    help="Sampling seed, where the server honours one (enters the cache key).")]


def _group(param: str, options: dict[str, tuple[Any, Any]], build: Callable[..., Any]
           ) -> Callable[[Command], Command]:
    """A decorator adding ``options`` ({name: (Annotated alias, default)}) to a command's
    signature (what typer reads) and passing the command ``param`` = ``build(**values)``."""

    def decorate(fn: Command) -> Command:
        own = [p.replace(annotation=_resolved(p.annotation, fn))
               for p in inspect.signature(fn).parameters.values() if p.name != param]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=alias,
                                   default=default) for name, (alias, default) in options.items()]

        @functools.wraps(fn)
        def command(**values: Any) -> None:
            grouped = {name: values.pop(name) for name in options}
            fn(**values, **{param: build(**grouped)})

        command.__signature__ = inspect.Signature(own + added)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in own + added}
        return command

    return decorate


def _resolved(annotation: Any, fn: Command) -> Any:
    """A string annotation evaluated where ``fn`` was written; one naming a type imported for
    type checking only (another group's object, which that group removes) stays a string."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, inspect.unwrap(fn).__globals__)  # noqa: S307 - the source's own
    except NameError:
        return annotation


_LLM: dict[str, tuple[Any, Any]] = {
    "base_url": (BaseUrls, None), "concurrency": (Concurrency, 16), "rpm": (Rpm, None),
    "tpm": (Tpm, None), "timeout": (Timeout, 120.0), "parse_retries": (ParseRetries, 2),
    "max_cost": (MaxCost, None), "prices": (Prices, None), "batch": (Batch, None),
    "thinking": (Thinking, "off"), "structured_output": (StructuredOutput, "auto"),
    "system_role": (SystemRole, "keep"), "use_n": (UseN, True),
    "temperature": (Temperature, None), "seed": (Seed, None), "adapt": (Adapt, None),
    "max_reply_mib": (MaxReplyMib, 32.0)}


def llm_options(*names: str, model: tuple[Any, Any] = (Model, ...)
                ) -> Callable[[Command], Command]:
    """The "LLM options" (all, or those ``names``) and ``--model`` → ``llm: LLMSettings``
    (None when ``model`` may be left out and was)."""
    chosen = {"model": model, **{n: o for n, o in _LLM.items() if not names or n in names}}

    def build(model: str | None, thinking: str = "off", system_role: str = "keep",
              adapt: bool | None = None, **values: Any) -> LLMSettings | None:
        from draco_cli.llm.settings import LLMSettings

        if model is None:
            return None
        return LLMSettings(model=model, thinking=thinking == "on",
                           system_role=system_role == "keep", adaptive=adapt, **values)

    return _group("llm", chosen, build)


def prompt_options() -> Callable[[Command], Command]:
    """The "Prompt options" → ``prompt: PromptOptions``."""

    def build(redact: list[str] | None, **values: Any) -> PromptOptions:
        from draco_cli.options import PromptOptions

        return PromptOptions.build(redact=tuple(redact or ()), **values)

    return _group("prompt", {"max_tokens": (MaxTokens, 4096),
                             "max_prompt_tokens": (MaxPromptTokens, 24000),
                             "redact": (Redact, None),
                             "no_default_redact": (NoDefaultRedact, False)}, build)


# --- rubric and judge stages (RubricOptions, JudgeOptions check the values) -------------
MaxCriteria = Annotated[int, rubric_option(help="Criteria per group at most, after the merge.")]
StaticRubric = Annotated[Path | None, rubric_option(
    parser=IN, help="Static rubric file for the static settings (default: draco's own).")]
RubricStages = Annotated[str, rubric_option(help="Comma-separated stages to run.")]
Candidates = Annotated[Path | None, rubric_option(
    parser=IN, help="With --stages merge: merge another run's candidate pool (its "
    "rubric_candidates.parquet, or the rubric or run folder holding it) instead of new ones.")]
JudgeModel = Annotated[str | None, judge_option(help="Judge model, if not --model.")]
Samples = Annotated[int, judge_option(help="Judge samples per rollout (k).")]
AggregateOpt = Annotated[Aggregate, judge_option(
    help="How judge samples combine: all (fail if any sample fails, pass only if all pass) or "
    "majority.")]
JudgeLabel = Annotated[str, judge_option(help="Judge arm label stored with the verdicts.")]

_RUBRIC: dict[str, tuple[Any, Any]] = {
    "max_criteria": (MaxCriteria, 8), "stages": (RubricStages, "generate,union,merge"),
    "static_rubric": (StaticRubric, None), "candidates": (Candidates, None)}
_JUDGE: dict[str, tuple[Any, Any]] = {
    "judge_model": (JudgeModel, None), "samples": (Samples, 1), "aggregate": (AggregateOpt, "all"),
    "judge_label": (JudgeLabel, "judge")}


def _stage_options(param: str, table: dict[str, tuple[Any, Any]], cls: str
                   ) -> Callable[..., Callable[[Command], Command]]:
    """The group ``*names`` of ``table`` → ``param``: ``draco_cli.options.<cls>`` (the "Rubric
    options" → ``rubric: RubricOptions``, the "Judge options" → ``judge: JudgeOptions``)."""

    def options(*names: str) -> Callable[[Command], Command]:
        def build(**values: Any) -> Any:
            import draco_cli.options

            return getattr(draco_cli.options, cls).build(**values)

        return _group(param, {n: table[n] for n in names}, build)

    return options


rubric_options = _stage_options("rubric", _RUBRIC, "RubricOptions")
judge_options = _stage_options("judge", _JUDGE, "JudgeOptions")
