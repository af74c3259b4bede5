from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from draco_cli.cli.options import folder_path
from draco_cli.cli.options import BaseUrl, Force
from draco_cli.cli.output import Format, Json, Report, emit, pick_format
from draco_cli.errors import UsageError

app = typer.Typer(help="Audits: self-judge agreement, rubric overlap and statistics, cost.",
                  no_args_is_help=True)

OutOpt = Annotated[Path, typer.Option("-o", "--out", help="Output folder for Parquet tables.",
                                      callback=folder_path)]
RolloutsOpt = Annotated[Optional[Path], typer.Option(
    "--rollouts", help="rollouts.parquet, for train_step and task_id.")]


def _write(out: Path, tables: dict, force: bool) -> None:
    from draco_cli.io import atomic_path, check_writable

    for name in tables:
        check_writable(out / f"{name}.parquet", force)
    for name, df in tables.items():
        with atomic_path(out / f"{name}.parquet", force) as tmp:
            df.write_parquet(tmp)


def _read_verdicts(path: Path, judge: str | None):
    import polars as pl

    from draco_cli.io import read_table
    from draco_cli.schemas import VerdictAggregated

    v = read_table(path, VerdictAggregated)
    return v.filter(pl.col("judge") == judge) if judge else v


def _verdicts_of(path: Path, judge: str | None):
    """Verdicts from a file, or from a draco run folder (its judge/verdicts.parquet, with the
    run's rollouts and train step)."""
    import polars as pl

    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout

    from draco_cli.runfolder import RunFolder

    if not path.is_dir():
        return _read_verdicts(path, judge), None, None
    if not RunFolder.is_run_folder(path):
        raise UsageError(f"{path}: a folder without manifest.json; give a draco run folder or "
                         "a verdicts.parquet file")
    folder = RunFolder.open(path)
    step = folder.train_step
    r = read_table(folder.rollouts, Rollout,
                   columns=["rollout_id", "group_id", "task_id", "train_step"])
    if step is not None:
        r = r.with_columns(pl.lit(step, pl.Int32).alias("train_step"))
    v = _read_verdicts(folder.table("verdicts"), judge)
    return v, r, step


def _pairs(selfs: list[Path], refs: list[Path]) -> list[tuple[Path, Path]]:
    """Pair --self with --reference: by train step when every input is a run folder with one
    (whatever the order given), else in the order given."""

    from draco_cli.runfolder import RunFolder

    def step(p: Path):
        return RunFolder.open(p).train_step if p.is_dir() and RunFolder.is_run_folder(p) \
            else None

    for a, b in zip(selfs, refs):
        if a.is_dir() != b.is_dir():
            raise UsageError(f"--self {a} and --reference {b}: pair run folders with run "
                             "folders and files with files")
    sa, sb = [step(p) for p in selfs], [step(p) for p in refs]
    if len(selfs) == 1 and None not in sa + sb and sa != sb:
        raise UsageError(f"--self {selfs[0]} is train step {sa[0]} but --reference {refs[0]} is "
                         f"train step {sb[0]}: compare two judges on the same step's rollouts")
    if len(selfs) == 1 or None in sa + sb:
        if len(selfs) > 1 and any(x is not None for x in sa + sb):
            raise UsageError("some run folders have a train step and some not: make every run "
                             "folder with --train-step, or audit them one pair at a time")
        return list(zip(selfs, refs))
    for side, steps in (("--self", sa), ("--reference", sb)):
        dup = sorted({x for x in steps if steps.count(x) > 1})
        if dup:
            raise UsageError(f"{side}: train step {dup[0]} given twice")
    if set(sa) != set(sb):
        missing = sorted(set(sa) ^ set(sb))
        raise UsageError(f"train step {missing[0]} has a --self or a --reference folder but not "
                         "both: give one pair per training step")
    by_step = dict(zip(sb, refs))
    return [(a, by_step[x]) for a, x in zip(selfs, sa)]


@app.command("self-judge")
def self_judge(
    self_v: Annotated[list[Path], typer.Option(
        "--self", help="The candidate judge's verdicts (file or run folder; repeat it, paired "
        "with --reference, for several training steps).")],
    reference: Annotated[list[Path], typer.Option(
        "--reference", help="The reference judge's verdicts (file or run folder).")],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    self_judge_label: Annotated[Optional[str], typer.Option(
        "--self-judge", help="Judge label to take from --self if it holds several.")] = None,
    reference_judge: Annotated[Optional[str], typer.Option(
        help="Judge label to take from --reference if it holds several.")] = None,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Agreement of a self-judge with a reference judge, overall, per train step and first vs
    last quarter, with z-test and trend p-values → OUT/agreement.parquet, OUT/tests.parquet.

    Example: draco audit self-judge --self run/self/verdicts.parquet --reference run/gpt/verdicts.parquet --rollouts run/rollouts.parquet -o run/audit
    """
    import polars as pl

    from draco_cli.audit import self_judge_audit

    fmt = pick_format(fmt, as_json)
    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout

    from draco_cli.errors import InputError

    if len(self_v) != len(reference):
        raise typer.BadParameter("give as many --reference as --self (one pair per step)",
                                 param_hint="--reference")
    selfs, refs, rolls = [], [], []
    for a, b in _pairs(self_v, reference):
        va, ra, step = _verdicts_of(a, self_judge_label)
        vb, _, _ = _verdicts_of(b, reference_judge)
        shared = va.select("rollout_id", "criterion_id").join(
            vb.select("rollout_id", "criterion_id"), on=["rollout_id", "criterion_id"]).height
        if shared == 0:
            raise InputError(f"--self {a} and --reference {b} share no (rollout_id, "
                             "criterion_id): judge the same rollouts with the same rubric")
        if step is not None and len(self_v) > 1:
            # rollout ids repeat across steps: key them by step so the pairs stay apart
            tag = pl.col("rollout_id") + f"@{step}"
            va, vb, ra = (x.with_columns(tag.alias("rollout_id")) for x in (va, vb, ra))
        selfs.append(va)
        refs.append(vb)
        if ra is not None:
            rolls.append(ra)
    if rollouts is not None and rolls:
        raise typer.BadParameter("run folders carry their own rollouts and train steps; give "
                                 "--rollouts only with verdict files", param_hint="--rollouts")
    if rollouts is not None:
        rolls = [read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id",
                                                        "train_step"])]
    r = pl.concat(rolls, how="vertical_relaxed") if rolls else None
    agreement, tests = self_judge_audit(pl.concat(selfs, how="vertical_relaxed"),
                                        pl.concat(refs, how="vertical_relaxed"), r)
    _write(out, {"agreement": agreement, "tests": tests}, force)
    overall = agreement.filter(agreement["scope"] == "overall").to_dicts()[0]
    emit(Report([("self-judge vs reference", agreement)] + ([("tests", tests)] if tests.height
                                                            else []),
                document={"overall": overall, "scopes": agreement.to_dicts(),
                          "tests": tests.to_dicts()}), fmt)


def _rubric_table(path: Path, level: str, read_arrow):
    """A rubric table with the columns --level needs, or a one-line error naming the file."""
    import polars as pl

    from draco_cli.errors import InputError

    df = pl.from_arrow(read_arrow(path))
    table = "rubric_candidates" if level == "rollout" else "rubrics"
    for col in ("title", "requirement", "origin_rollout_id" if level == "rollout" else "group_id"):
        if col not in df.columns:
            raise InputError(f"missing column: --level {level} compares {table} tables",
                             file=str(path), field=col)
    return df


@app.command("overlap")
def overlap(
    own: Annotated[Path, typer.Option("--own", help="Your rubric table (rubric_candidates for "
                                      "--level rollout, rubrics for --level group).")],
    reference: Annotated[Path, typer.Option("--reference", help="The reference rubric table.")],
    out: OutOpt,
    fmt: Format = None,
    as_json: Json = False,
    level: Annotated[Literal["rollout", "group"], typer.Option(
        help="rollout (generation) or group (merge).")] = "group",
    matcher: Annotated[Literal["lexical", "embedding", "llm"], typer.Option(
        help="lexical (offline), embedding or llm.")]
    = "lexical",
    model: Annotated[Optional[str], typer.Option(
        help="Matcher model: provider/model for llm, openai/EMBEDDING for embedding.")] = None,
    base_url: BaseUrl = None,
    threshold: Annotated[float, typer.Option(help="Similarity that counts as a match "
                                             "(lexical, embedding).")] = 0.5,
    rollouts: RolloutsOpt = None,
    force: Force = False,
) -> None:
    """Recall and precision of your rubric writer against a reference, matched one-to-one,
    per train step and overall, with the reference's ceiling → OUT/overlap*.parquet.

    Example: draco audit overlap --own self/rubrics.parquet --reference gpt/rubrics.parquet --level group --rollouts d/rollouts.parquet -o audit
    """

    from draco_cli.audit import lexical_similarity, overlap_audit
    from draco_cli.io import read_arrow, read_table
    from draco_cli.schemas import Rollout

    r = read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id",
                                               "train_step"]) if rollouts else None
    a, b = _rubric_table(own, level, read_arrow), _rubric_table(reference, level, read_arrow)
    if matcher == "lexical":
        sim = lexical_similarity
    elif matcher == "embedding":
        from draco_cli.matchers import EmbeddingMatcher

        sim = EmbeddingMatcher(model or "", base_url)
    elif matcher == "llm":
        if not model:
            raise typer.BadParameter("--matcher llm needs --model")
        from draco_cli.llm.calllog import CallLog
        from draco_cli.llm.client import LLMClient
        from draco_cli.matchers import LLMMatcher

        out.mkdir(parents=True, exist_ok=True)
        log = CallLog(out / "llm_calls.sqlite")
        sim = LLMMatcher(LLMClient(model, call_log=log, base_url=base_url))
        threshold = 0.5
    else:
        raise typer.BadParameter("--matcher takes lexical, embedding or llm")
    per_unit, summary = overlap_audit(a, b, level, r, sim, threshold)
    if matcher == "llm":
        log.close()
    _write(out, {"overlap": summary, "overlap_units": per_unit}, force)
    emit(Report([(f"overlap ({level} level, {matcher} matcher)", summary)],
                keys=["overlap"]), pick_format(fmt, as_json))


@app.command("rubric")
def rubric(
    rubrics: Annotated[Path, typer.Option("--rubrics", help="rubrics.parquet.")],
    verdicts: Annotated[Path, typer.Option("--verdicts", help="Aggregated verdicts.parquet.")],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    judge: Annotated[Optional[str], typer.Option(help="Judge label, if several.")] = None,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Rubric statistics: discriminative share, criteria per group, single-task criteria and
    their share of judgments, na rate per criterion (worst first), failure share of verdicts.

    Example: draco audit rubric --rubrics d/rubric/rubrics.parquet --verdicts d/judge/verdicts.parquet --rollouts d/rollouts.parquet -o audit
    """
    from draco_cli.audit import rubric_audit
    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout, Rubric

    r = read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id"]) \
        if rollouts else None
    summary, per = rubric_audit(read_table(rubrics, Rubric), _read_verdicts(verdicts, judge), r)
    _write(out, {"rubric_summary": summary, "rubric_criteria": per}, force)
    fmt = pick_format(fmt, as_json)
    emit(Report([("rubric statistics", summary),
                 ("na rate per criterion (worst 10)" if fmt == "table" else "criteria",
                  per.select("title", "judgments", "na_rate", "fails", "passes").head(10)
                  if fmt == "table" else per)], keys=["summary", "criteria"]), fmt)


@app.command("cost")
def cost(
    calls: Annotated[list[Path], typer.Option("--calls", help="Call log (llm_calls.sqlite or "
                                              "its Parquet export) or a draco run folder; "
                                              "repeat it for several training steps.")],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    replay_cost: Annotated[Optional[list[Path]], typer.Option(
        "--replay-cost", help="replay_cost.parquet of `draco replay run` (or its folder); "
        "repeatable. Adds replay and reconstruction rows to the cost by category.")] = None,
    steps: Annotated[Optional[Path], typer.Option(
        "--steps", help="steps.parquet: the original rollouts' actions and tokens.")] = None,
    prices: Annotated[Optional[Path], typer.Option(
        help="Price table JSON for the naive client's dollars (default: the shipped one).")]
    = None,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Calls, tokens and dollars per phase and per train step, and the projection per 100
    training steps → OUT/cost_phase.parquet, OUT/cost_step.parquet; cost by category
    (original, replay, reconstruction, judge, rubric writing, candidate scoring: tokens,
    environment actions, dollars) → OUT/cost_category.parquet; billed tokens and dollars next
    to a naive client's (one call per sample, no prompt caching, no batch discount) →
    OUT/cost_naive.parquet.

    Example: draco audit cost --calls runs/step-0 --calls runs/step-1 -o audit
    """

    import polars as pl

    from draco_cli.audit import cost_audit, read_calls
    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout

    from draco_cli.runfolder import RunFolder

    frames = []
    for path in calls:
        step = None
        if path.is_dir():
            if RunFolder.is_run_folder(path):
                folder = RunFolder.open(path)
                step, path = folder.train_step, folder.call_log
            else:
                path = path / "llm_calls.sqlite"
        frames.append(read_calls(path).with_columns(pl.lit(step, pl.Int32).alias("train_step")))
    r = read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id",
                                               "train_step"]) if rollouts else None
    per_phase, per_step, projected = cost_audit(pl.concat(frames, how="diagonal_relaxed"), r)
    from draco_cli.credo.diagnostics import cost_by_category

    rc = [pl.read_parquet(p / "replay_cost.parquet" if p.is_dir() else p)
          for p in (replay_cost or [])]
    r_full = read_table(rollouts, Rollout, columns=["rollout_id", "response_len"]) \
        if rollouts else None
    by_cat = cost_by_category(pl.concat(frames, how="diagonal_relaxed"), r_full,
                              pl.read_parquet(steps) if steps else None,
                              pl.concat(rc, how="diagonal_relaxed") if rc else None)
    from draco_cli.audit import billed_vs_naive
    from draco_cli.llm.prices import PriceTable

    naive = billed_vs_naive(pl.concat(frames, how="diagonal_relaxed"), PriceTable.load(prices))
    _write(out, {"cost_phase": per_phase, "cost_step": per_step, "cost_category": by_cat,
                 "cost_naive": naive}, force)
    total = float(per_phase["cost_usd"].sum()) if per_phase.height else 0.0
    emit(Report([("cost by category", by_cat), ("cost per phase", per_phase),
                 ("billed vs a naive client (k calls, no caching, no batch)", naive)]
                + ([("cost per train step", per_step)] if per_step.height else []),
                document={"per_phase": per_phase.to_dicts(), "per_step": per_step.to_dicts(),
                          "by_category": by_cat.to_dicts(), "billed_vs_naive": naive.to_dicts(),
                          "total_usd": total, "projected_usd_per_100_steps": projected},
                lines=[f"total ${total:.4f}" + (f"; projected per 100 steps ${projected:.2f}"
                                                if projected is not None else "")]),
         pick_format(fmt, as_json))
