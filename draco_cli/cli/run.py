from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from draco_cli.cli import llmrun
from draco_cli.cli.console import err_console, remote_named
from draco_cli.cli.output import Format, Json, Report, emit, pick_format
from draco_cli.cli.credit import DropoutSeedOpt, RubricDropoutOpt
from draco_cli.errors import Interrupted
from draco_cli.choices import (STAGES, CreditKind, Drop, Estimator, RewardSource, Setting,
                               StdMode, TokenForm)
from draco_cli.cli.options import (OUT, CallLogPath, credit_option, llm_option, spot_option,
                                   Rollouts, Steps, folder_path, judge_options, llm_options,
                                   prompt_options, rubric_options)

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.run.pipeline import RunResult, StageEvent
    from draco_cli.options import JudgeOptions, PromptOptions, RubricOptions


# typer takes a list of Literal values only as an Enum
Stage = Enum("Stage", {name: name for name in STAGES}, type=str)  # type: ignore[misc]

RunModel = Annotated[str | None, llm_option(
    "--model", help="provider/model (openai/gpt-4.1, anthropic/…, openai/NAME with --base-url, "
    "replay/PATH); not needed for --setting outcome.")]


@llm_options(model=(RunModel, None))
@prompt_options()
@judge_options("judge_model", "samples", "aggregate", "judge_label")
@rubric_options("max_criteria", "static_rubric")
def run(
    rollouts: Rollouts,
    steps: Steps,
    out: Annotated[Path, typer.Option("-o", "--out", help="Run folder (or RUN_ROOT with "
                                      "--train-step: RUN_ROOT/step-N).",
                                      callback=folder_path, parser=OUT)],
    setting: Annotated[Setting, typer.Option(
        help="draco (dynamic rubrics + step credit), no-credit (dynamic rubrics, uniform), "
        "static (static rubric + step credit), static-no-credit, or outcome (vanilla GRPO on "
        "the environment outcome, uniform, no LLM call).")] = "draco",
    train_step: Annotated[int | None, typer.Option(
        help="Write into OUT/step-N (N ≥ 0). Token advantages name step N where the rollouts "
        "do not say theirs; rollouts that say another step are refused.")]
    = None,
    credit: Annotated[CreditKind | None, credit_option(
        help="Override the setting's credit: step or uniform.")] = None,
    reward: Annotated[RewardSource | None, credit_option(
        help="Override the setting's reward: rubric (pass fraction of retained criteria) or "
        "outcome (the environment's).")] = None,
    estimator: Annotated[Estimator, credit_option(help="Group baseline.")] = "grpo",
    std: Annotated[StdMode, credit_option(help="GRPO's std: sample (verl), population, none.")]
    = "sample",
    drop: Annotated[Drop, credit_option(help="Which criteria the discriminative filter drops.")]
    = "all-pass",
    tokens: Annotated[TokenForm, credit_option(help="Token-advantage form to write.")]
    = "spans",
    rubric_dropout: RubricDropoutOpt = 0.0,
    dropout_seed: DropoutSeedOpt = 0,
    redo: Annotated[list[Stage] | None, typer.Option(
        help="Redo this stage and every stage after it even if unchanged (repeatable); "
        "answers already in the call log are reused.")] = None,
    min_answered: Annotated[float, typer.Option(
        help="Health check: fail the run (exit 1) when a stage's share of answered calls is "
        "below this (0 to 1).")] = 0.9,
    min_signal: Annotated[float, typer.Option(
        help="Signal check: fail the run (exit 1) when no more than this share of rollouts "
        "(0 to 1) has a non-zero advantage; a run whose filter dropped every criterion fails "
        "too.")] = 0.0,
    allow_no_signal: Annotated[bool, typer.Option(
        "--allow-no-signal", metavar="", help="Accept a step that gives the trainer no "
        "learning signal (the signal check reports it, exit 0).")] = False,
    restart: Annotated[bool, typer.Option(
        "--restart", metavar="", help="The run folder holds a run of other inputs: clear its "
        "tables and start over (its call log is kept; answers are reused). Without it such a "
        "folder is refused.")] = False,
    no_wait: Annotated[bool, typer.Option(
        "--no-wait", metavar="", help="Refuse, instead of waiting, when another draco run is "
        "writing the same folder.")] = False,
    call_log: CallLogPath = None,
    fmt: Format = None,
    as_json: Json = False,
    engine: Annotated[Literal["local", "ray"], typer.Option(
        help="Where the LLM stages run: local (this process) or ray (a Ray cluster's workers, "
        "partitioned by group; needs the ray extra).")] = "local",
    ray_address: Annotated[str | None, typer.Option(
        help="Ray cluster address for --engine ray (default: a local cluster).")] = None,
    partitions: Annotated[int | None, typer.Option(
        help="Partitions of the groups for --engine ray, each one task with its own "
        "call log (default: the cluster's CPUs).")] = None,
    spot_check: Annotated[int, spot_option(
        min=0, help="Each step, ask N of the training judge's verdicts (sampled with "
        "--spot-check-seed) again of a gold judge (--spot-check-model), same prompt and "
        "rubric → judge/spot_checks.parquet; never changes the reward.")] = 0,
    spot_check_model: Annotated[str | None, spot_option(
        help="The gold judge's provider/model (other LLM options as --model's).")] = None,
    spot_check_base_url: Annotated[str | None, spot_option(
        help="Base URL of the gold judge's OpenAI-compatible server (default: none, the "
        "provider's own API).")] = None,
    spot_check_thinking: Annotated[Literal["on", "off"], spot_option(
        help="on|off: thinking for the gold judge.")] = "off",
    spot_check_seed: Annotated[int, spot_option(
        min=0, help="Seed of the spot-check sample (with the train step).")] = 0,
    *, llm: LLMSettings | None, prompt: PromptOptions, judge: JudgeOptions,
    rubric: RubricOptions,
) -> None:
    """One training step: rubric → judge → filter → credit, resumable and idempotent.

    Example: draco run --rollouts sample_data/appworld_mini/rollouts.parquet --steps sample_data/appworld_mini/steps.parquet --model replay/sample_data/llm_calls.sqlite -o runs/demo
    """
    from draco_cli.run.pipeline import RunOptions, run_dir_for, run_step

    fmt_name = pick_format(fmt, as_json)

    # every option is checked here, before any table is read or any call is made
    opts = RunOptions.for_setting(
        setting, credit=credit, reward=reward, rubric=rubric, prompt=prompt, judge=judge,
        credit_options={"estimator": estimator, "std": std, "drop": drop, "tokens": tokens,
                        "rubric_dropout": rubric_dropout, "dropout_seed": dropout_seed},
        train_step=train_step, min_answered=min_answered, min_signal=min_signal,
        allow_no_signal=allow_no_signal, restart=restart,
        redo=tuple(s.value for s in redo or ()), call_log=call_log, engine=engine,
        ray_address=ray_address, partitions=partitions, spot_check=spot_check,
        spot_check_seed=spot_check_seed)
    gold = llmrun.gold_settings(llm, spot_check_model, spot_check_base_url,
                                spot_check_thinking == "on")
    if llm is not None:
        from draco_cli.llm.settings import check_samples

        check_samples(judge.samples, llm.temperature, llm.use_n)
    run_dir = run_dir_for(out, train_step)

    def waiting(holder: str) -> None:
        err_console.print(f"waiting: another draco run (pid {holder}) is writing {run_dir}",
                          highlight=False)

    if llm is not None and llm.batch:   # only with --batch: draco run calls online by default
        llmrun.announce_batch(llm)
    try:
        with llmrun.progress_bar("run") as bar:
            result = run_step(rollouts, steps, out, llm, opts, train_step, progress=bar,
                              on_event=_on_event, wait=not no_wait, on_wait=waiting,
                              gold=gold)
    except KeyboardInterrupt:
        log = call_log or run_dir / "llm_calls.sqlite"
        raise Interrupted(f"interrupted: rerun the same command to resume (answered calls are "
                          f"kept in {log}; none is paid twice)") from None
    _summary(result, run_dir, fmt_name)


def _on_event(e: StageEvent) -> None:
    if e.event == "start" and e.stage in ("judge", "credit"):
        # this process only (the library leaves the allocators alone): the memory the earlier
        # stage freed goes back to the system before this stage allocates afresh
        import pyarrow as pa

        from draco_cli._allocator import release_freed_memory

        release_freed_memory()
        if e.stage == "credit":   # Arrow's buffers from the C heap, which numpy reuses
            pa.set_memory_pool(pa.system_memory_pool())
    _print_event(e)


def _print_event(e: StageEvent) -> None:
    from draco_cli.llm.answered import money

    def calls() -> str:
        if e.answered is None or not e.answered.requests:
            return ""
        return (f", {e.answered} ({e.calls_new} new, {e.calls_reused} reused), "
                f"{money(e.cost_usd, e.priced)}")

    rows = f", {e.rows} rows" if e.rows is not None else ""
    if e.event == "start":
        line = f"{e.stage}: started"
    elif e.event == "reused":
        line = f"{e.stage}: reused (inputs and options unchanged){rows}"
    else:
        line = f"{e.stage}: {e.status} in {e.seconds:.1f} s{rows}{calls()}"
    err_console.print(line, highlight=False, markup=False)
    for reason, n in sorted(e.reasons.items(), key=lambda kv: -kv[1]):
        err_console.print(f"  - unanswered ×{n}: {reason}", highlight=False, markup=False)
    for note in e.notes if e.event == "end" else ():
        err_console.print(f"  - {note}", highlight=False, markup=False)


def summary_document(result: RunResult, run_dir: Path) -> dict[str, Any]:
    """The run's results as one JSON-able document (``draco run --format json``)."""
    m = result.manifest
    calls = m["llm_calls"]
    unpriced = bool(calls) and all(v.get("cost_usd") is None for v in calls.values())
    credit = m["stages"].get("credit", {})
    stats = credit.get("stats", {}) or {}
    return {
        "run_dir": remote_named(str(run_dir)), "status": m.get("status"), "train_step": m.get("train_step"),
        "setting": (m.get("settings") or {}).get("setting"),
        "reward": credit.get("reward"),
        "groups": stats.get("groups"), "rollouts": stats.get("rollouts"),
        "criteria_kept": stats.get("criteria_kept"),
        "criteria_dropped": stats.get("criteria_dropped"),
        "criteria_dropout": stats.get("criteria_dropout"),
        "credit_modes": stats.get("credit_modes"),
        "llm_call_rows": sum(v.get("rows", 0) for v in calls.values()),
        "cost_usd": None if unpriced else sum(v.get("cost_usd") or 0 for v in calls.values()),
        "wall_seconds": m.get("wall_seconds"), "skipped": list(result.skipped),
        "healthy": bool(result.healthy), "budget_reached": bool(result.budget_reached),
        "health": m.get("health"),
        "token_advantages": remote_named(m["token_advantages"]) if m.get("token_advantages")
        else None,
    }


def _summary(result: RunResult, run_dir: Path, fmt: str = "table") -> None:
    m = result.manifest
    doc = summary_document(result, run_dir)
    if fmt != "table":  # the results on stdout for tools; the lines below stay on stderr
        import polars as pl

        flat = {k: v for k, v in doc.items() if not isinstance(v, (dict, list))}
        emit(Report([("run", pl.DataFrame([flat]))], document=doc), fmt)
    if result.skipped:
        err_console.print(f"unchanged, skipped: {', '.join(result.skipped)}", highlight=False)
    credit = m["stages"].get("credit", {})
    stats = credit.get("stats", {})
    if stats:
        modes = ", ".join(f"{k} {v}" for k, v in stats["credit_modes"].items())
        err_console.print(f"{stats['groups']} groups, {stats['rollouts']} rollouts; "
                          + (f"criteria kept {stats['criteria_kept']}"
                             + (f" ({stats['criteria_dropout']} of them left out by "
                                "--rubric-dropout)" if stats.get("criteria_dropout") else "")
                             + f" / dropped {stats['criteria_dropped']}; "
                             if credit.get("reward") != "outcome" else
                             "reward: the environment outcome; ")
                          + f"credit modes: {modes}", highlight=False)
    from draco_cli.llm.answered import money

    spent = "unpriced model" if doc["cost_usd"] is None else f"{money(doc['cost_usd'])} in all"
    err_console.print(f"LLM calls logged: {doc['llm_call_rows']} rows, {spent}; "
                      f"{m['wall_seconds']:.1f} s", highlight=False)
    health = m.get("health") or {}
    for message in health.get("messages", []):
        err_console.print(f"[red]unhealthy:[/] {message}", highlight=False)
    if result.budget_reached:
        err_console.print("[yellow]budget reached (--max-cost): rerun with a higher budget to "
                          "resume[/]")
        raise typer.Exit(1)
    signal = health.get("signal") or {}
    if signal.get("allowed"):
        err_console.print(f"[yellow]no learning signal (allowed):[/] {signal['problem']}",
                          highlight=False)
    if not result.healthy:
        answered_ok = all(s.get("ok", True) for s in (health.get("stages") or {}).values())
        what = ("signal check failed" if answered_ok else
                f"health check failed (--min-answered {health.get('threshold')})")
        err_console.print(f"[red]{what}[/]; see {run_dir}/manifest.json; fix the cause and "
                          "rerun the same command: answered calls are reused", highlight=False)
        raise typer.Exit(1)
    if m["status"] == "partial":
        err_console.print("[yellow]some calls went unanswered[/]: rerun the same command to "
                          "ask them again (answered ones are reused)", highlight=False)
    err_console.print(f"[green]token advantages:[/] {m['token_advantages']}", highlight=False)
    err_console.print(f"next: draco report {run_dir} -o {run_dir}/report.html", highlight=False)
