"""What every LLM command shares: a progress bar and the closing summary."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import typer

from draco_cli.cli.console import err_console

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.llm.stage import StageReport


class BarProgress(Protocol):
    """What the bar shows: the LLM client's ``Progress``, or any work counted alike (replays).
    A ``note`` attribute, when present, says what a long wait is waiting for."""

    @property
    def done(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def failed(self) -> int: ...
    @property
    def cost_usd(self) -> float: ...


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[Callable[[BarProgress], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, \
        TimeElapsedColumn
    from rich.progress import Progress as Bar

    from draco_cli.llm.answered import money

    with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("failed {task.fields[failed]}  {task.fields[cost]}"),
                  TimeElapsedColumn(), console=err_console, transient=True,
                  disable=not err_console.is_terminal) as bar:
        tasks: dict[int, TaskID] = {}

        def update(p: BarProgress) -> None:
            key = p.total
            if key not in tasks:
                tasks[key] = bar.add_task(label, total=p.total, failed=0, cost="")
            note = getattr(p, "note", None)
            bar.update(tasks[key], completed=p.done, failed=p.failed,
                       cost=money(p.cost_usd, getattr(p, "priced", True)),
                       description=f"{label}: {note}" if note else label)

        yield update


def announce_batch(llm: LLMSettings | None) -> None:
    """Say so when the calls go through a provider's batch API: its answers take hours."""
    from draco_cli.llm.stage import batching

    if llm is not None and batching(llm):
        err_console.print(f"batch: the calls to {llm.model} go through the provider's batch API "
                          "(half price; answers typically within hours, up to 24 h; the command "
                          "waits and resumes from its call log). --no-batch calls online.",
                          highlight=False, markup=False)


def print_report(report: StageReport) -> None:
    from rich.table import Table

    from draco_cli.llm.answered import Answered, money

    t = Table(title="LLM calls", title_justify="left", box=None, pad_edge=False)
    for col in ("phase", "requests", "answered", "reused", "HTTP calls", "retried", "input",
                "cached in", "output", "reasoning", "USD"):
        t.add_column(col, justify="right" if col != "phase" else "left")
    total = 0.0
    priced = True
    for phase, s in report.phases.items():
        u = s.usage
        ok = getattr(s, "priced", True)
        priced = priced and ok
        figure = Answered.of([s])
        t.add_row(phase, str(figure.requests), f"{figure.answered} ({figure.percent})",
                  str(s.cached), str(s.calls), str(s.failed_attempts), f"{u.input_tokens:,}",
                  f"{u.cached_tokens:,}", f"{u.output_tokens:,}", f"{u.reasoning_tokens:,}",
                  money(s.cost_usd, ok))
        total += s.cost_usd
    err_console.print(t)
    err_console.print(f"{Answered.of(report.phases.values())}; total "
                      + (money(total) if priced else
                         "unpriced (the model is not in the price table; --prices FILE)"),
                      highlight=False)
    for note in report.notes:
        err_console.print(f"- {note}", highlight=False)
    if report.budget_reached:
        raise typer.Exit(1)
    err_console.print("[green]wrote[/] " + ", ".join(str(p) for p in report.outputs),
                      highlight=False)


def gold_settings(llm: LLMSettings | None, model: str | None, base_url: str | None,
                  thinking: bool) -> LLMSettings | None:
    """The gold judge of ``--spot-check``: the run's LLM settings (concurrency, timeouts,
    structured output…) with its own model, base URL and thinking."""
    from dataclasses import replace

    from draco_cli.errors import UsageError
    from draco_cli.llm.settings import LLMSettings

    if model is None:
        if base_url is not None:
            raise UsageError("--spot-check-base-url: give --spot-check-model too")
        return None
    if llm is None:
        return LLMSettings(model=model, base_url=base_url, thinking=thinking)
    return replace(llm, model=model, base_url=base_url, thinking=thinking)
