from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import BaseUrl, Force

app = typer.Typer(help="Audits: self-judge agreement, rubric overlap and statistics, cost.",
                  no_args_is_help=True)

OutOpt = Annotated[Path, typer.Option("-o", "--out", help="Output folder for Parquet tables.")]
RolloutsOpt = Annotated[Optional[Path], typer.Option(
    "--rollouts", help="rollouts.parquet, for train_step and task_id.")]


def _table(title: str, df, digits: int = 4) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for c in df.columns:
        t.add_column(c, justify="left" if df[c].dtype == str or c in ("scope", "metric", "test",
                                                                       "phase", "unit", "title")
                     else "right")
    for row in df.iter_rows():
        t.add_row(*["—" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)
                    for v in row])
    err_console.print(t)


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
    import json

    import polars as pl

    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout

    if not path.is_dir():
        return _read_verdicts(path, judge), None
    m = json.loads((path / "manifest.json").read_text())
    r = read_table(Path(m["inputs"]["rollouts"]["path"]), Rollout,
                   columns=["rollout_id", "group_id", "task_id", "train_step"])
    if m.get("train_step") is not None:
        r = r.with_columns(pl.lit(m["train_step"], pl.Int32).alias("train_step"))
    v = _read_verdicts(path / "judge" / "verdicts.parquet", judge)
    # rollout ids repeat across steps: key them by step so the pairs stay apart
    step = m.get("train_step")
    if step is not None:
        v = v.with_columns((pl.col("rollout_id") + f"@{step}").alias("rollout_id"))
        r = r.with_columns((pl.col("rollout_id") + f"@{step}").alias("rollout_id"))
    return v, r


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
    as_json: Annotated[bool, typer.Option("--json", help="Print overall figures and p-values "
                                          "as JSON on stdout.")] = False,
    force: Force = False,
) -> None:
    """Agreement of a self-judge with a reference judge, overall, per train step and first vs
    last quarter, with z-test and trend p-values → OUT/agreement.parquet, OUT/tests.parquet.

    Example: draco audit self-judge --self run/self/verdicts.parquet --reference run/gpt/verdicts.parquet --rollouts run/rollouts.parquet -o run/audit
    """
    import polars as pl

    from draco_cli.audit import self_judge_audit
    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout

    if len(self_v) != len(reference):
        raise typer.BadParameter("give as many --reference as --self (one pair per step)")
    selfs, refs, rolls = [], [], []
    for a, b in zip(self_v, reference):
        va, ra = _verdicts_of(a, self_judge_label)
        vb, _ = _verdicts_of(b, reference_judge)
        if ra is not None and b.is_dir() is False:
            raise typer.BadParameter("pair run folders with run folders")
        selfs.append(va)
        refs.append(vb)
        if ra is not None:
            rolls.append(ra)
    if rollouts is not None:
        rolls = [read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id",
                                                        "train_step"])]
    r = pl.concat(rolls, how="vertical_relaxed") if rolls else None
    agreement, tests = self_judge_audit(pl.concat(selfs, how="vertical_relaxed"),
                                        pl.concat(refs, how="vertical_relaxed"), r)
    _write(out, {"agreement": agreement, "tests": tests}, force)
    _table("self-judge vs reference", agreement)
    if tests.height:
        _table("tests", tests)
    if as_json:
        overall = agreement.filter(agreement["scope"] == "overall").to_dicts()[0]
        typer.echo(json.dumps({"overall": overall, "tests": tests.to_dicts()}))


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
    level: Annotated[str, typer.Option(help="rollout (generation) or group (merge).")] = "group",
    matcher: Annotated[str, typer.Option(help="lexical (offline), embedding or llm.")]
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
    import polars as pl

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
    _table(f"overlap ({level} level, {matcher} matcher)", summary)


@app.command("rubric")
def rubric(
    rubrics: Annotated[Path, typer.Option("--rubrics", help="rubrics.parquet.")],
    verdicts: Annotated[Path, typer.Option("--verdicts", help="Aggregated verdicts.parquet.")],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    judge: Annotated[Optional[str], typer.Option(help="Judge label, if several.")] = None,
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
    _table("rubric statistics", summary)
    _table("na rate per criterion (worst 10)",
           per.select("title", "judgments", "na_rate", "fails", "passes").head(10))


@app.command("cost")
def cost(
    calls: Annotated[list[Path], typer.Option("--calls", help="Call log (llm_calls.sqlite or "
                                              "its Parquet export) or a draco run folder; "
                                              "repeat it for several training steps.")],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    force: Force = False,
) -> None:
    """Calls, tokens and dollars per phase and per train step, and the projection per 100
    training steps → OUT/cost_phase.parquet, OUT/cost_step.parquet.

    Example: draco audit cost --calls runs/step-0 --calls runs/step-1 -o audit
    """
    import json

    import polars as pl

    from draco_cli.audit import cost_audit, read_calls
    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout

    frames = []
    for path in calls:
        step = None
        if path.is_dir():
            manifest = path / "manifest.json"
            step = json.loads(manifest.read_text()).get("train_step") if manifest.exists() \
                else None
            path = path / "llm_calls.sqlite"
        frames.append(read_calls(path).with_columns(pl.lit(step, pl.Int32).alias("train_step")))
    r = read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id",
                                               "train_step"]) if rollouts else None
    per_phase, per_step, projected = cost_audit(pl.concat(frames, how="diagonal_relaxed"), r)
    _write(out, {"cost_phase": per_phase, "cost_step": per_step}, force)
    _table("cost per phase", per_phase)
    if per_step.height:
        _table("cost per train step", per_step)
    total = float(per_phase["cost_usd"].sum()) if per_phase.height else 0.0
    err_console.print(f"total ${total:.4f}" + (f"; projected per 100 steps ${projected:.2f}"
                                               if projected is not None else ""), highlight=False)
