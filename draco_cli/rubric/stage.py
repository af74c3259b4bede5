"""Rubric operations (``draco rubric generate`` / ``static``): read rollouts and steps, write
criteria with an LLM (or apply a fixed rubric), publish the rubric tables as one set."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from draco_cli.errors import InputError
from draco_cli.io import OutputSet, check_writable, read_table
from draco_cli.llm.settings import LLMSettings
from draco_cli.llm.types import Sampling
from draco_cli.llm.stage import (CHUNK_ROLLOUTS, run_llm_stage, ROLLOUT_COLUMNS, StageReport, chunk_frames, read_inputs, render_messages)
from draco_cli.prompts.render import RenderOptions
from draco_cli.rubric.core import (RubricResult, load_static_rubric, rubric_stage, stage_requests,
                                   static_rubrics)
from draco_cli.schemas import Rollout, Rubric, RubricCandidate

if TYPE_CHECKING:
    from draco_cli.llm.drive import Stage


def rubric_generate(rollouts: str | Path, steps: str | Path, out: Path, settings: LLMSettings,
                    *, stages: tuple[str, ...], max_criteria: int, render: RenderOptions,
                    max_tokens: int = 4096, call_log: Path | None = None, force: bool = False,
                    progress: Callable[[Any], None] | None = None,
                    chunk_rollouts: int = CHUNK_ROLLOUTS,
                    candidates: Path | None = None) -> StageReport:
    """Criteria per group → ``out/rubric_candidates.parquet`` and ``out/rubrics.parquet``.

    Groups are written in chunks of about ``chunk_rollouts`` rollouts (``llmstage``): memory
    follows the chunk, not the input; the tables are the same as from one pass over all."""
    out = Path(out)
    targets = [out / "rubric_candidates.parquet", out / "rubrics.parquet"]
    for t in targets:
        check_writable(t, force)
    r, s = read_inputs(rollouts, steps)
    pool = None if candidates is None else _candidate_pool(Path(candidates), r)
    sampling = Sampling(max_tokens=max_tokens, thinking=settings.thinking)
    summary = _Summary()

    def chunks() -> tuple[Iterator[Stage[RubricResult]], int]:
        groups = r.group_by("group_id", maintain_order=True).agg(pl.len().alias("n"))
        start = pl.col("n").cum_sum() - pl.col("n")
        groups = groups.with_columns(
            ((start // max(1, chunk_rollouts)).rank("dense") - 1).alias("__c"))
        chunk = r.select("group_id").join(groups.select("group_id", "__c"), on="group_id",
                                           how="left", maintain_order="left")["__c"]
        total = r.height + 2 * groups.height   # generate + union, merge
        return (rubric_stage(cr, cs, stages=stages, max_criteria=max_criteria, render=render,
                             sampling=sampling, pool=pool)
                for cr, cs in chunk_frames(r, s, chunk)), total

    def tables(res: RubricResult) -> dict[str, pl.DataFrame]:
        summary.add(res)
        return {targets[0].name: res.candidates, targets[1].name: res.rubrics}

    report = run_llm_stage(out, {targets[0].name: RubricCandidate, targets[1].name: Rubric},
                           settings, call_log, chunks=chunks, tables_of=tables, force=force,
                           progress=progress,
                           whole=rubric_stage(r, s, stages=stages, max_criteria=max_criteria,
                                              render=render, sampling=sampling, pool=pool,
                                              warm=False))
    if report.budget_reached:
        return report
    if summary.missing:
        report.notes.append(f"{summary.missing} group(s) got no criteria "
                            f"(unanswered calls): {', '.join(summary.missing_first)}")
    if summary.merge_fallback:
        report.notes.append(f"{summary.merge_fallback} group(s) whose merge call went "
                            "unanswered are judged on their candidates (capped at "
                            f"--max-criteria); a rerun asks the merge again")
    if summary.capped:
        report.notes.append(f"{summary.capped} criteria beyond --max-criteria {max_criteria} "
                            "dropped")
    report.notes.append(f"{summary.criteria} criteria for {summary.groups} "
                        f"groups, {summary.candidates} candidates")
    report.rows = summary.criteria
    return report


def _candidate_pool(path: Path, rollouts: pl.DataFrame) -> pl.DataFrame:
    """Another run's ``rubric_candidates`` (the file, or a rubric or run folder holding it),
    for the groups of ``rollouts``; a group with none is an error naming it."""
    for p in (path, path / "rubric_candidates.parquet", path / "rubric" / "rubric_candidates.parquet"):
        if p.is_file():
            break
    else:
        raise InputError("no rubric_candidates.parquet here (give the file, or the rubric or "
                         "run folder that holds it)", file=str(path))
    pool = read_table(p, RubricCandidate)
    have = set(pool["group_id"].unique().to_list())
    missing = [g for g in rollouts["group_id"].unique(maintain_order=True).to_list()
               if g not in have]
    if missing:
        raise InputError(f"no candidates for group {missing[0]!r} ({len(missing)} groups "
                         "without): the pool must come from a run on the same groups",
                         file=str(p), field="group_id")
    return pool


class _Summary:
    """What the report says about the rubric tables, added up over the chunks."""

    def __init__(self) -> None:
        self.missing = self.capped = self.criteria = self.groups = self.candidates = 0
        self.merge_fallback = 0
        self.missing_first: list[str] = []

    def add(self, res: RubricResult) -> None:
        self.missing += len(res.groups_without_rubric)
        self.missing_first += res.groups_without_rubric[: 5 - len(self.missing_first)]
        self.capped += res.capped
        self.merge_fallback += len(res.merge_fallback)
        self.criteria += res.rubrics.height
        self.groups += res.rubrics["group_id"].n_unique()   # a group is in one chunk only
        self.candidates += res.candidates.height


def rubric_static(rollouts: str | Path, rubric_file: Path | None, out: Path,
                  force: bool = False) -> tuple[int, int, Path]:
    """One fixed rubric for every group → ``out/rubrics.parquet``; returns (criteria, groups,
    the table written)."""
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
    r, s = read_inputs(rollouts, steps)
    if r.height == 0:
        raise InputError("no rollouts, so no prompt to show", file=str(rollouts))
    first_group = r["group_id"][0]
    jobs = stage_requests(r.filter(pl.col("group_id") == first_group), s, (stage,),
                          max_criteria, render, Sampling())
    return render_messages(jobs[0][3].messages)
