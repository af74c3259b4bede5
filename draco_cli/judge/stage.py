"""Judge operations (``draco judge score`` / ``filter``): score rollouts against their group's
rubric with an LLM, or mark the criteria the discriminative filter keeps; each publishes its
outputs as one set."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from draco_cli.errors import InputError
from draco_cli.io import check_writable, read_table
from draco_cli.judge.core import ScoreResult, ScoreStats, score_stage
from draco_cli.llm.settings import LLMSettings
from draco_cli.llm.types import Sampling
from draco_cli.publish import publish_file, source_name
from draco_cli.llm.stage import (CHUNK_ROLLOUTS, run_llm_stage, StageReport, chunk_frames, read_inputs,
                                    render_messages)
from draco_cli.choices import Aggregate, Drop
from draco_cli.prompts.render import RenderOptions
from draco_cli.schemas import Rollout, Rubric, VerdictAggregated, VerdictRaw

if TYPE_CHECKING:
    from draco_cli.llm.drive import Stage


def judge_score(rollouts: str | Path, steps: str | Path, rubrics: str | Path, out: Path,
                settings: LLMSettings, *, samples: int, aggregate: Aggregate, judge_label: str,
                render: RenderOptions, max_tokens: int = 4096, call_log: Path | None = None,
                force: bool = False, progress: Callable[[Any], None] | None = None,
                chunk_rollouts: int = CHUNK_ROLLOUTS) -> StageReport:
    """Verdicts citing steps → ``out/verdicts_raw.parquet`` (one row per sample) and
    ``out/verdicts.parquet`` (aggregated).

    Rollouts are scored in chunks of ``chunk_rollouts`` in file order (``llmstage``): memory
    follows the chunk, not the input; the tables are the same as from one pass over all."""
    out = Path(out)
    targets = [out / "verdicts_raw.parquet", out / "verdicts.parquet"]
    for t in targets:
        check_writable(t, force)
    r, s = read_inputs(rollouts, steps)
    rb = read_table(rubrics, Rubric)
    sampling = Sampling(max_tokens=max_tokens, thinking=settings.thinking)
    summary = _Summary()

    def chunks() -> tuple[Iterator[Stage[ScoreResult]], int]:
        size = max(1, chunk_rollouts)
        chunk = pl.int_range(0, r.height, dtype=pl.Int64, eager=True) // size
        judged = r["group_id"].is_in(rb["group_id"].unique().implode()).sum() * samples
        return (score_stage(cr, cs, rb.filter(pl.col("group_id").is_in(
                                cr["group_id"].unique().implode())),
                            samples=samples, aggregate=aggregate, judge=judge_label,
                            sampling=sampling, render=render)
                for cr, cs in chunk_frames(r, s, chunk)), int(judged)

    def tables(res: ScoreResult) -> dict[str, pl.DataFrame]:
        summary.add(res)
        return {targets[0].name: res.raw, targets[1].name: res.verdicts}

    report = run_llm_stage(out, {targets[0].name: VerdictRaw, targets[1].name: VerdictAggregated},
                           settings, call_log, chunks=chunks, tables_of=tables, force=force,
                           progress=progress,
                           whole=score_stage(r, s, rb, samples=samples, aggregate=aggregate,
                                             judge=judge_label, sampling=sampling, render=render))
    if report.budget_reached:
        return report
    n = summary.verdicts
    null = summary.unanswered
    report.rows = n
    # Not an "answered" figure (that is the stage's requests, one per sample): an aggregated
    # verdict is also null where the samples disagree, which is no failure of the judge. A
    # criterion an answer left out makes that answer invalid (verdict_check), so unanswered.
    report.notes.append(f"{n} verdicts ({summary.raw} sample rows); {null} without a verdict "
                        f"({null / n:.1%}: no answer, or the samples disagree)" if n
                        else "no verdicts")
    st = summary.stats
    if st.citations_dropped:
        report.notes.append(f"{st.citations_dropped} citation"
                            f"{'s' if st.citations_dropped != 1 else ''} outside 1..M dropped")
    if st.unknown_ids:
        report.notes.append(f"{st.unknown_ids} verdicts for unknown criterion ids ignored")
    if st.missing:
        report.notes.append(f"{st.missing} criteria missing from answers (unanswered)")
    if summary.without_rubric:
        report.notes.append(f"{summary.without_rubric} rollouts skipped: their group has no "
                            "rubric")
    if summary.repeated and not summary.split:   # k samples paid for, one answer's worth
        report.notes.append(f"the {samples} samples agreed on every one of the "
                            f"{summary.repeated} verdicts answered more than once: here they "
                            "add calls, not information (--samples 1, or a higher "
                            "--temperature)")
    return report


class _Summary:
    """What the report says about the verdict tables, added up over the chunks."""

    def __init__(self) -> None:
        self.verdicts = self.unanswered = self.raw = self.without_rubric = 0
        self.repeated = self.split = 0   # verdicts answered by ≥ 2 samples; those that differ
        self.stats = ScoreStats()

    def add(self, res: ScoreResult) -> None:
        self.verdicts += res.verdicts.height
        self.unanswered += res.verdicts["verdict"].null_count()
        self.raw += res.raw.height
        self.without_rubric += res.rollouts_without_rubric
        if res.raw.height > res.verdicts.height:   # k > 1
            per = res.raw.filter(pl.col("verdict").is_not_null()).group_by(
                "rollout_id", "criterion_id", "judge").agg(
                pl.len().alias("k"), pl.col("verdict").n_unique().alias("kinds")).filter(
                pl.col("k") > 1)
            self.repeated += per.height
            self.split += int((per["kinds"] > 1).sum())
        for name in ("unknown_ids", "citations_dropped", "missing", "unanswered_samples"):
            setattr(self.stats, name, getattr(self.stats, name) + getattr(res.stats, name))


def judge_prompt(rollouts: str | Path, steps: str | Path, rubrics: str | Path, *,
                 render: RenderOptions, samples: int = 1) -> str:
    """The rendered judge prompt of the first rollout, without calling anything."""
    r, s = read_inputs(rollouts, steps)
    if r.height == 0:
        raise InputError("no rollouts, so no prompt to show", file=str(rollouts))
    first = next(score_stage(r.head(1), s.filter(pl.col("rollout_id") == r["rollout_id"][0]),
                             read_table(rubrics, Rubric), samples=samples, render=render), None)
    if first is None:
        raise InputError("the first rollout's group has no criteria, so no prompt to show",
                         file=str(rubrics))
    return render_messages(next(iter(first)).messages)


def judge_filter(rollouts: str | Path, verdicts: str | Path, out: str | Path, *,
                 drop: Drop = "all-pass", judge: str | None = None, force: bool = False
                 ) -> tuple[int, int]:
    """The aggregated verdicts of one judge with ``retained`` set by the discriminative filter
    → ``out`` (published whole, under the folder's lock); returns (retained, all) (group,
    criterion) pairs."""
    from draco_cli.credit import attach_groups, discriminative_filter, narrow_judge

    check_writable(out, force)
    r = read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id"])
    v = narrow_judge(read_table(verdicts, VerdictAggregated), judge, source_name(verdicts))
    v = discriminative_filter(attach_groups(v, r, source_name(verdicts)), drop)
    publish_file(v.drop("group_id", "__r", strict=False), out, VerdictAggregated, force=force)
    pairs = v.unique(["group_id", "criterion_id"])
    return int(pairs["retained"].sum()), pairs.height
