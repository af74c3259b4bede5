"""What the LLM operations (rubric generation, judge scoring) share: the inputs they read, the
prompt rendering options, the call log they resume from and the report they end with."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from draco_cli.io import read_table
from draco_cli.llm.calllog import export_parquet
from draco_cli.redact import Redactor
from draco_cli.render import RenderOptions
from draco_cli.schemas import Rollout, Step

if TYPE_CHECKING:
    from draco_cli.llm.client import PhaseStats

ROLLOUT_COLUMNS = ["rollout_id", "group_id", "task_id", "instruction"]
STEP_COLUMNS = ["rollout_id", "step", "action", "observation"]


@dataclass
class StageReport:
    """What an LLM operation reports at its end (the command prints it)."""

    phases: dict[str, PhaseStats] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)
    budget_reached: bool = False
    rows: int = 0                 # rows of the stage's main output table
    items: int = 0                # what the stage's answers had to cover (judge: verdicts)
    items_answered: int = 0


def read_inputs(rollouts: str | Path, steps: str | Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rollout and step columns a prompt is rendered from."""
    return (read_table(rollouts, Rollout, columns=ROLLOUT_COLUMNS),
            read_table(steps, Step, columns=STEP_COLUMNS))


def render_options(max_prompt_tokens: int, redact: list[str], no_default_redact: bool
                   ) -> RenderOptions:
    return RenderOptions(max_prompt_tokens=max_prompt_tokens,
                         redactor=Redactor(redact, defaults=not no_default_redact))


def call_log_path(out: Path, call_log: Path | None) -> Path:
    return call_log if call_log is not None else out / "llm_calls.sqlite"


def finish(client: Any, log_path: Path, out: Path, report: StageReport) -> None:
    """The client's phase statistics into ``report``, and the call log's Parquet export."""
    report.phases.update(client.stats)
    report.budget_reached = client.budget_reached
    export_parquet(log_path, out / "llm_calls.parquet", force=True)
    if not client.priced:
        report.notes.append(f"{client.model} is not in the price table: its cost shows as $0 "
                            "(pass --prices FILE to price it)")


def log_position(log_path: Path) -> int:
    """The call log's last row id (0 when there is none yet): rows after it are this run's."""
    if not Path(log_path).exists():
        return 0
    conn = sqlite3.connect(f"file:{log_path}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM calls").fetchone()[0])
    except sqlite3.OperationalError:  # a log without its table yet
        return 0
    finally:
        conn.close()


def unanswered_reasons(log_path: Path, phases: list[str], after: int) -> dict[str, int]:
    """Why samples of ``phases`` logged after row ``after`` stayed unanswered, counted per
    reason, read-only from the call log."""
    if not Path(log_path).exists() or not phases:
        return {}
    conn = sqlite3.connect(f"file:{log_path}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            f"SELECT error, COUNT(*) FROM calls WHERE status = 'unanswered' AND phase IN "
            f"({','.join('?' * len(phases))}) AND rowid > ? GROUP BY error",
            (*phases, after)).fetchall()
    finally:
        conn.close()
    out: dict[str, int] = {}
    for error, n in rows:
        # one line, short: the reason names a kind of failure, not a whole server answer
        reason = (str(error or "no reason recorded").splitlines() or ["?"])[0][:120]
        out[reason] = out.get(reason, 0) + int(n)
    return out


def render_messages(messages: list[dict[str, Any]]) -> str:
    """A request's messages as text (``--show-prompt``)."""
    return "\n\n".join(f"===== {m['role']} =====\n{m['content']}" for m in messages)
