"""File-level LLM stages behind ``draco rubric ...`` and ``draco judge score``: read tables,
run the stage through the LLM layer with its call log, write tables atomically."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from draco_cli.io import OutputSet, check_writable, folder_lock, prepare_out_dir, read_table
from draco_cli.llm.calllog import CallLog, export_parquet
from draco_cli.llm.settings import LLMSettings
from draco_cli.llm.types import Sampling
from draco_cli.redact import Redactor
from draco_cli.render import RenderOptions
from draco_cli.schemas import Rollout, Rubric, RubricCandidate, Step, VerdictAggregated, VerdictRaw

ROLLOUT_COLUMNS = ["rollout_id", "group_id", "task_id", "instruction"]
STEP_COLUMNS = ["rollout_id", "step", "action", "observation"]


@dataclass
class StageReport:
    """What the command prints at the end."""

    phases: dict = field(default_factory=dict)   # phase -> PhaseStats
    notes: list[str] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)
    budget_reached: bool = False
    rows: int = 0                 # rows of the stage's main output table
    items: int = 0                # what the stage's answers had to cover (judge: verdicts)
    items_answered: int = 0


def log_position(log_path: Path) -> int:
    """The call log's last row id (0 when there is none yet): rows after it are this run's."""
    import sqlite3

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
    import sqlite3

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


def _inputs(rollouts, steps):
    r = read_table(rollouts, Rollout, columns=ROLLOUT_COLUMNS)
    s = read_table(steps, Step, columns=STEP_COLUMNS)
    return r, s


def render_options(max_prompt_tokens: int, redact: list[str], no_default_redact: bool
                   ) -> RenderOptions:
    return RenderOptions(max_prompt_tokens=max_prompt_tokens,
                         redactor=Redactor(redact, defaults=not no_default_redact))


def _call_log_path(out: Path, call_log: Path | None) -> Path:
    return call_log if call_log is not None else out / "llm_calls.sqlite"


def _finish(client, log_path: Path, out: Path, report: StageReport) -> None:
    report.phases.update(client.stats)
    report.budget_reached = client.budget_reached
    export_parquet(log_path, out / "llm_calls.parquet", force=True)
    if not client.priced:
        report.notes.append(f"{client.model} is not in the price table: its cost shows as $0 "
                            "(pass --prices FILE to price it)")


def rubric_generate(rollouts, steps, out: Path, settings: LLMSettings, *,
                    stages: tuple[str, ...], max_criteria: int, render: RenderOptions,
                    max_tokens: int = 4096, call_log: Path | None = None, force: bool = False,
                    progress=None) -> StageReport:
    from draco_cli.rubric import generate_rubrics

    targets = [out / "rubric_candidates.parquet", out / "rubrics.parquet"]
    for t in targets:
        check_writable(t, force)
    r, s = _inputs(rollouts, steps)
    report = StageReport(outputs=targets)
    log_path = _call_log_path(out, call_log)
    # The folder stays locked through the calls: a second writer would pay for them again.
    with folder_lock(prepare_out_dir(out)), CallLog(log_path) as log:
        client = settings.client(log)
        res = generate_rubrics(r, s, client, stages=stages, max_criteria=max_criteria,
                               render=render, batch=settings.batch, progress=progress,
                               sampling=Sampling(max_tokens=max_tokens,
                                                 thinking=settings.thinking))
        _finish(client, log_path, out, report)
    if report.budget_reached:
        report.notes.append("budget reached (--max-cost): tables not written; rerun to resume")
        return report
    with OutputSet(out, [t.name for t in targets], force=force) as output:
        output.write_table(res.candidates, targets[0].name, RubricCandidate)
        output.write_table(res.rubrics, targets[1].name, Rubric)
    if res.groups_without_rubric:
        report.notes.append(f"{len(res.groups_without_rubric)} group(s) got no criteria "
                            f"(unanswered calls): {', '.join(res.groups_without_rubric[:5])}")
    if res.capped:
        report.notes.append(f"{res.capped} criteria beyond --max-criteria {max_criteria} dropped")
    report.notes.append(f"{res.rubrics.height} criteria for {res.rubrics['group_id'].n_unique()} "
                        f"groups, {res.candidates.height} candidates")
    report.rows = res.rubrics.height
    return report


def rubric_static(rollouts, rubric_file: Path | None, out: Path, force: bool = False
                  ) -> tuple[int, int, Path]:
    from draco_cli.rubric import load_static_rubric, static_rubrics

    target = out / "rubrics.parquet"
    check_writable(target, force)
    r = read_table(rollouts, Rollout, columns=ROLLOUT_COLUMNS)
    criteria = load_static_rubric(rubric_file)
    rb = static_rubrics(r, criteria)
    with OutputSet(out, [target.name], force=force) as output:
        output.write_table(rb, target.name, Rubric)
    return len(criteria), r["group_id"].n_unique(), target


def judge_score(rollouts, steps, rubrics, out: Path, settings: LLMSettings, *, samples: int,
                aggregate: str, judge_label: str, render: RenderOptions, max_tokens: int = 4096,
                call_log: Path | None = None, force: bool = False, progress=None
                ) -> StageReport:
    from draco_cli.judge import score_rollouts

    targets = [out / "verdicts_raw.parquet", out / "verdicts.parquet"]
    for t in targets:
        check_writable(t, force)
    r, s = _inputs(rollouts, steps)
    rb = read_table(rubrics, Rubric)
    report = StageReport(outputs=targets)
    log_path = _call_log_path(out, call_log)
    # The folder stays locked through the calls: a second writer would pay for them again.
    with folder_lock(prepare_out_dir(out)), CallLog(log_path) as log:
        client = settings.client(log)
        res = score_rollouts(r, s, rb, client, samples=samples, aggregate=aggregate,
                             judge=judge_label, render=render, batch=settings.batch,
                             progress=progress,
                             sampling=Sampling(max_tokens=max_tokens, thinking=settings.thinking))
        _finish(client, log_path, out, report)
    if report.budget_reached:
        report.notes.append("budget reached (--max-cost): tables not written; rerun to resume")
        return report
    with OutputSet(out, [t.name for t in targets], force=force) as output:
        output.write_table(res.raw, targets[0].name, VerdictRaw)
        output.write_table(res.verdicts, targets[1].name, VerdictAggregated)
    n = res.verdicts.height
    unanswered = res.verdicts["verdict"].null_count()
    report.rows = n
    # per sample: a sample verdict left null is an unanswered call or a criterion the answer
    # left out; aggregated nulls also count samples that disagree, which is not a failure
    report.items = res.raw.height
    report.items_answered = res.raw.height - res.raw["verdict"].null_count()
    report.notes.append(f"{n} verdicts ({res.raw.height} sample rows); unanswered "
                        f"{unanswered} ({unanswered / n:.1%})" if n else "no verdicts")
    st = res.stats
    if st.citations_dropped:
        report.notes.append(f"{st.citations_dropped} citations outside 1..M dropped")
    if st.unknown_ids:
        report.notes.append(f"{st.unknown_ids} verdicts for unknown criterion ids ignored")
    if st.missing:
        report.notes.append(f"{st.missing} criteria missing from answers (unanswered)")
    if res.rollouts_without_rubric:
        report.notes.append(f"{res.rollouts_without_rubric} rollouts skipped: their group has no "
                            "rubric")
    return report


def show_prompt(rollouts, steps, which: str, *, rubrics=None, max_criteria: int = 8,
                render: RenderOptions, samples: int = 1) -> str:
    """The rendered prompt of the first rollout (or group), without calling anything."""
    from draco_cli.judge import score_request
    from draco_cli.rubric import stage_requests

    r, s = _inputs(rollouts, steps)
    if r.height == 0:
        from draco_cli.errors import InputError

        raise InputError("no rollouts, so no prompt to show", file=str(rollouts))
    if which == "score":
        rb = read_table(rubrics, Rubric)
        first = r.row(0, named=True)
        crit = rb.filter(pl.col("group_id") == first["group_id"])
        req = score_request(first["rollout_id"], first["instruction"],
                            s.filter(pl.col("rollout_id") == first["rollout_id"]).sort("step"),
                            crit, samples, Sampling(), render)
    else:
        first_group = r["group_id"][0]
        jobs = stage_requests(r.filter(pl.col("group_id") == first_group), s, (which,),
                              max_criteria, render, Sampling())
        req = jobs[0][3]
    return "\n\n".join(f"===== {m['role']} =====\n{m['content']}" for m in req.messages)
