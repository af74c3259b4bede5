"""Rubric operations (``draco rubric generate`` / ``static``): read rollouts and steps, write
criteria with an LLM (or apply a fixed rubric), publish the rubric tables as one set."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from draco_cli.errors import InputError
from draco_cli.io import OutputSet, check_writable, folder_lock, prepare_out_dir, read_table
from draco_cli.llm.calllog import CallLog
from draco_cli.llm.settings import LLMSettings
from draco_cli.llm.types import Sampling
from draco_cli.ops.llmstage import (ROLLOUT_COLUMNS, StageReport, call_log_path, finish,
                                    read_inputs, render_messages)
from draco_cli.render import RenderOptions
from draco_cli.schemas import Rollout, Rubric, RubricCandidate


def rubric_generate(rollouts: str | Path, steps: str | Path, out: Path, settings: LLMSettings,
                    *, stages: tuple[str, ...], max_criteria: int, render: RenderOptions,
                    max_tokens: int = 4096, call_log: Path | None = None, force: bool = False,
                    progress: Callable[[Any], None] | None = None) -> StageReport:
    """Criteria per group → ``out/rubric_candidates.parquet`` and ``out/rubrics.parquet``."""
    from draco_cli.rubric import generate_rubrics

    out = Path(out)
    targets = [out / "rubric_candidates.parquet", out / "rubrics.parquet"]
    for t in targets:
        check_writable(t, force)
    r, s = read_inputs(rollouts, steps)
    report = StageReport(outputs=targets)
    log_path = call_log_path(out, call_log)
    # The folder stays locked through the calls: a second writer would pay for them again.
    with folder_lock(prepare_out_dir(out)), CallLog(log_path) as log:
        client = settings.client(log)
        res = generate_rubrics(r, s, client, stages=stages, max_criteria=max_criteria,
                               render=render, progress=progress,
                               batch=settings.batch,
                               sampling=Sampling(max_tokens=max_tokens,
                                                 thinking=settings.thinking))
        finish(client, log_path, out, report)
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


def rubric_static(rollouts: str | Path, rubric_file: Path | None, out: Path,
                  force: bool = False) -> tuple[int, int, Path]:
    """One fixed rubric for every group → ``out/rubrics.parquet``; returns (criteria, groups,
    the table written)."""
    from draco_cli.rubric import load_static_rubric, static_rubrics

    out = Path(out)
    target = out / "rubrics.parquet"
    check_writable(target, force)
    r = read_table(rollouts, Rollout, columns=ROLLOUT_COLUMNS)
    criteria = load_static_rubric(rubric_file)
    rb = static_rubrics(r, criteria)
    with OutputSet(out, [target.name], force=force) as output:
        output.write_table(rb, target.name, Rubric)
    return len(criteria), r["group_id"].n_unique(), target


def rubric_prompt(rollouts: str | Path, steps: str | Path, stage: str, *, max_criteria: int = 8,
                  render: RenderOptions) -> str:
    """The rendered ``stage`` prompt (generate or union) of the first group, without calling
    anything (``--show-prompt``)."""
    from draco_cli.rubric import stage_requests

    r, s = read_inputs(rollouts, steps)
    if r.height == 0:
        raise InputError("no rollouts, so no prompt to show", file=str(rollouts))
    first_group = r["group_id"][0]
    jobs = stage_requests(r.filter(pl.col("group_id") == first_group), s, (stage,),
                          max_criteria, render, Sampling())
    return render_messages(jobs[0][3].messages)
