"""Audit operations (``draco audit self-judge | overlap | rubric | cost``): read verdicts,
rubrics, call logs or run folders, call the pure audits of ``draco_cli.audit``, and publish each
command's tables as one locked output set checked against their contracts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from draco_cli.errors import InputError, UsageError
from draco_cli.io import check_writable, read_arrow, read_table
from draco_cli.publish import publish_tables
from draco_cli.run.folder import RunFolder
from draco_cli.schemas import (
    Agreement,
    AgreementTest,
    CostCategory,
    CostNaive,
    CostPhase,
    CostStep,
    Overlap,
    OverlapTest,
    OverlapUnit,
    Rollout,
    Rubric,
    RubricCriterionStats,
    RubricSummary,
    VerdictAggregated,
)

AUDIT_ROLLOUT_COLUMNS = ["rollout_id", "group_id", "task_id", "train_step"]


def _refuse_existing(out: Path, names: list[str], force: bool) -> None:
    """Before any work: outputs that exist are refused without --force."""
    for name in names:
        check_writable(Path(out) / f"{name}.parquet", force)


def _rollouts(path: Path | None, columns: list[str]) -> pl.DataFrame | None:
    return read_table(path, Rollout, columns=columns) if path is not None else None


# --- self-judge -------------------------------------------------------------------------


def read_verdicts(path: Path, judge: str | None, option: str = "--judge") -> pl.DataFrame:
    """One judge's verdicts, chosen as ``draco credit compute --judge`` chooses them: a label
    the file does not hold, or several judges and no label, is a usage error naming
    ``option`` (never an empty or mixed table audited without a word)."""
    from draco_cli.credit import narrow_judge

    return narrow_judge(read_table(path, VerdictAggregated), judge, str(path), option)


def verdicts_of(path: Path, judge: str | None, option: str
                ) -> tuple[pl.DataFrame, pl.DataFrame | None, int | None]:
    """Verdicts from a file, or from a draco run folder (its judge/verdicts.parquet, with the
    run's rollouts and train step): (verdicts, rollouts or None, train step or None)."""
    path = Path(path)
    if not path.is_dir():
        return read_verdicts(path, judge, option), None, None
    if not RunFolder.is_run_folder(path):
        raise UsageError(f"{path}: a folder without manifest.json; give a draco run folder or "
                         "a verdicts.parquet file")
    folder = RunFolder.open(path)
    step = folder.train_step
    r = read_table(folder.rollouts, Rollout, columns=AUDIT_ROLLOUT_COLUMNS)
    if step is not None:
        r = r.with_columns(pl.lit(step, pl.Int32).alias("train_step"))
    return read_verdicts(folder.table("verdicts"), judge, option), r, step


def pair_by_step(selfs: list[Path], refs: list[Path]) -> list[tuple[Path, Path]]:
    """Pair --self with --reference: by train step when every input is a run folder with one
    (whatever the order given), else in the order given."""
    def step(p: Path) -> int | None:
        return RunFolder.open(p).train_step if p.is_dir() and RunFolder.is_run_folder(p) \
            else None

    if len(selfs) != len(refs):
        raise UsageError("--reference: give as many --reference as --self (one pair per step)")
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
        dup = sorted({x for x in steps if x is not None and steps.count(x) > 1})
        if dup:
            raise UsageError(f"{side}: train step {dup[0]} given twice")
    if set(sa) != set(sb):
        missing = sorted(x for x in set(sa) ^ set(sb) if x is not None)
        raise UsageError(f"train step {missing[0]} has a --self or a --reference folder but not "
                         "both: give one pair per training step")
    by_step = dict(zip(sb, refs))
    return [(a, by_step[x]) for a, x in zip(selfs, sa)]


def audit_self_judge(selfs: list[Path], refs: list[Path], out: Path, *,
                     rollouts: Path | None = None, self_judge: str | None = None,
                     reference_judge: str | None = None, force: bool = False
                     ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Agreement of a self-judge with a reference judge → ``out/agreement.parquet`` and
    ``out/tests.parquet``; returns (agreement, tests)."""
    from draco_cli.audit import self_judge_audit

    _refuse_existing(out, ["agreement", "tests"], force)
    self_frames, ref_frames, rolls = [], [], []
    for a, b in pair_by_step([Path(p) for p in selfs], [Path(p) for p in refs]):
        va, ra, step = verdicts_of(a, self_judge, "--self-judge")
        vb, _, _ = verdicts_of(b, reference_judge, "--reference-judge")
        shared = va.select("rollout_id", "criterion_id").join(
            vb.select("rollout_id", "criterion_id"), on=["rollout_id", "criterion_id"]).height
        if shared == 0:
            raise InputError(f"--self {a} and --reference {b} share no (rollout_id, "
                             "criterion_id): judge the same rollouts with the same rubric")
        if step is not None and len(selfs) > 1:
            # rollout ids repeat across steps: key them by step so the pairs stay apart
            tag = pl.col("rollout_id") + f"@{step}"
            va, vb = (x.with_columns(tag.alias("rollout_id")) for x in (va, vb))
            ra = ra.with_columns(tag.alias("rollout_id")) if ra is not None else None
        self_frames.append(va)
        ref_frames.append(vb)
        if ra is not None:
            rolls.append(ra)
    if rollouts is not None and rolls:
        raise UsageError("--rollouts: run folders carry their own rollouts and train steps; "
                         "give --rollouts only with verdict files")
    if rollouts is not None:
        rolls = [read_table(rollouts, Rollout, columns=AUDIT_ROLLOUT_COLUMNS)]
    r = pl.concat(rolls, how="vertical_relaxed") if rolls else None
    agreement, tests = self_judge_audit(pl.concat(self_frames, how="vertical_relaxed"),
                                        pl.concat(ref_frames, how="vertical_relaxed"), r)
    t = publish_tables(out, {"agreement": (agreement, Agreement),
                             "tests": (tests, AgreementTest)}, force=force)
    return t["agreement"], t["tests"]


# --- overlap ----------------------------------------------------------------------------


def rubric_table(path: Path, level: str) -> pl.DataFrame:
    """A rubric table with the columns --level needs, or a one-line error naming the file."""
    df = pl.from_arrow(read_arrow(path))
    assert isinstance(df, pl.DataFrame)
    table = "rubric_candidates" if level == "rollout" else "rubrics"
    for col in ("title", "requirement", "origin_rollout_id" if level == "rollout" else "group_id"):
        if col not in df.columns:
            raise InputError(f"missing column: --level {level} compares {table} tables",
                             file=str(path), field=col)
    return df


def audit_overlap(own: Path, reference: Path, out: Path, *, level: str = "group",
                  matcher: str = "lexical", model: str | None = None,
                  base_url: str | None = None, threshold: float = 0.5,
                  rollouts: Path | None = None, force: bool = False
                  ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Recall and precision of a rubric writer against a reference, criteria compared by
    ``matcher`` (lexical, offline; embedding or llm, with ``model``) →
    ``out/overlap.parquet`` and ``out/overlap_units.parquet``; returns (summary, per unit)."""
    from draco_cli.audit import lexical_similarity, overlap_audit
    from draco_cli.audit.overlap import overlap_tests

    if level not in ("rollout", "group"):
        raise UsageError(f"--level {level!r}: choose rollout or group")
    if matcher == "llm" and not model:
        raise UsageError("--matcher llm needs --model")
    if matcher not in ("lexical", "embedding", "llm"):
        raise UsageError(f"--matcher {matcher!r}: choose lexical, embedding or llm")
    _refuse_existing(out, ["overlap", "overlap_units", "overlap_tests"], force)
    r = _rollouts(rollouts, AUDIT_ROLLOUT_COLUMNS)
    a, b = rubric_table(own, level), rubric_table(reference, level)

    def publish(sim: Any, threshold: float) -> tuple[pl.DataFrame, pl.DataFrame]:
        per_unit, summary = overlap_audit(a, b, level, r, sim, threshold)
        t = publish_tables(out, {"overlap": (summary, Overlap),
                                 "overlap_units": (per_unit, OverlapUnit),
                                 "overlap_tests": (overlap_tests(per_unit), OverlapTest)},
                           force=force)
        return t["overlap"], t["overlap_units"]

    if matcher == "llm":
        from draco_cli.audit.matchers import LLMMatcher
        from draco_cli.io import folder_lock, prepare_out_dir
        from draco_cli.llm.calllog import CallLog
        from draco_cli.llm.client import LLMClient

        # the folder stays locked through the calls: a second writer would pay them again
        with folder_lock(prepare_out_dir(out)), CallLog(Path(out) / "llm_calls.sqlite") as log:
            return publish(LLMMatcher(LLMClient(model or "", call_log=log,
                                                base_url=base_url)), 0.5)
    if matcher == "embedding":
        from draco_cli.audit.matchers import EmbeddingMatcher

        return publish(EmbeddingMatcher(model or "", base_url), threshold)
    return publish(lexical_similarity, threshold)


# --- rubric statistics ------------------------------------------------------------------


def audit_rubric(rubrics: Path, verdicts: Path, out: Path, *, rollouts: Path | None = None,
                 judge: str | None = None, force: bool = False
                 ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Rubric statistics → ``out/rubric_summary.parquet`` and ``out/rubric_criteria.parquet``;
    returns (summary, per criterion)."""
    from draco_cli.audit import rubric_audit

    _refuse_existing(out, ["rubric_summary", "rubric_criteria"], force)
    r = _rollouts(rollouts, ["rollout_id", "group_id", "task_id"])
    summary, per = rubric_audit(read_table(rubrics, Rubric), read_verdicts(verdicts, judge), r)
    t = publish_tables(out, {"rubric_summary": (summary, RubricSummary),
                             "rubric_criteria": (per, RubricCriterionStats)}, force=force)
    return t["rubric_summary"], t["rubric_criteria"]


# --- cost -------------------------------------------------------------------------------


@dataclass
class CostReport:
    per_phase: pl.DataFrame
    per_step: pl.DataFrame
    by_category: pl.DataFrame
    projected_per_100_steps: float | None
    naive: pl.DataFrame

    @property
    def total_usd(self) -> float | None:
        """None when every call is unpriced (the cost is unknown, not $0)."""
        cost = self.per_phase["cost_usd"] if self.per_phase.height else None
        if cost is not None and cost.null_count() == cost.len():
            return None
        return float(cost.sum()) if cost is not None else 0.0


def read_call_logs(calls: list[Path]) -> pl.DataFrame:
    """The cost rows of each log (a call log, its Parquet export, a folder holding one, or a
    run folder, whose train step labels its calls), stacked: the columns `audit cost` uses and
    each reply's ``call_key``, not the prompts and responses, which are most of a log."""
    from draco_cli.audit import AUDIT_COST_COLUMNS, read_cost_rows

    frames = []
    for path in calls:
        step = None
        path = Path(path)
        if path.is_dir():
            if RunFolder.is_run_folder(path):
                folder = RunFolder.open(path)
                step, path = folder.train_step, folder.call_log
            else:
                path = path / "llm_calls.sqlite"
        frames.append(read_cost_rows(path, AUDIT_COST_COLUMNS).with_columns(pl.lit(step, pl.Int32).alias("train_step")))
    return pl.concat(frames, how="diagonal_relaxed")


def audit_cost(calls: list[Path], out: Path, *, rollouts: Path | None = None,
               replay_cost: list[Path] | None = None, steps: Path | None = None,
               prices: Path | None = None, force: bool = False) -> CostReport:
    """Calls, tokens and dollars per phase, per train step and by category, and billed next to
    a naive client's → ``out/cost_phase.parquet``, ``out/cost_step.parquet``,
    ``out/cost_category.parquet``, ``out/cost_naive.parquet``."""
    from draco_cli.audit import billed_vs_naive, cost_audit
    from draco_cli.audit.cost import cost_categories
    from draco_cli.llm.prices import PriceTable

    _refuse_existing(out, ["cost_phase", "cost_step", "cost_category", "cost_naive"], force)
    log = read_call_logs(list(calls))
    r = _rollouts(rollouts, [*AUDIT_ROLLOUT_COLUMNS, "response_len"])
    per_phase, per_step, projected = cost_audit(log, r)
    rc = [pl.read_parquet(p / "replay_cost.parquet" if Path(p).is_dir() else p)
          for p in (replay_cost or [])]
    by_cat = cost_categories(log, r, pl.read_parquet(steps) if steps else None,
                              pl.concat(rc, how="diagonal_relaxed") if rc else None)
    naive = billed_vs_naive(log, PriceTable.load(prices))
    t = publish_tables(out, {"cost_phase": (per_phase, CostPhase),
                             "cost_step": (per_step, CostStep),
                             "cost_category": (by_cat, CostCategory),
                             "cost_naive": (naive, CostNaive)}, force=force)
    return CostReport(t["cost_phase"], t["cost_step"], t["cost_category"], projected,
                      t["cost_naive"])


# --- step labels ------------------------------------------------------------------------


@dataclass
class StepLabelReport:
    figures: pl.DataFrame
    labelers: list[str]
    rollouts: int
    out: Path | None


def credited_verdicts(verdicts: pl.DataFrame, rollouts: pl.DataFrame,
                      settings: dict[str, Any]) -> pl.DataFrame:
    """The verdicts with ``retained`` as the run's credit stage counted them. ``draco run``
    keeps the judge's verdicts unfiltered (``retained`` null): the filter and any rubric
    dropout are applied again with the run's own settings (``--drop``, ``--rubric-dropout``,
    ``--dropout-seed``)."""
    from draco_cli.credit import discriminative_filter
    from draco_cli.credit.dropout import apply_dropout

    if "retained" in verdicts.columns and verdicts["retained"].null_count() < verdicts.height:
        return verdicts.with_columns(pl.col("retained").fill_null(False))
    index = rollouts.select("rollout_id", "group_id").with_row_index("__r")
    v = discriminative_filter(verdicts.join(index, on="rollout_id", how="inner",
                                            maintain_order="left"),
                              settings.get("drop") or "all-pass")
    v, _ = apply_dropout(v, rollouts, float(settings.get("rubric_dropout") or 0.0),
                         int(settings.get("dropout_seed") or 0))
    return v.drop("__r", "group_id")


def audit_step_labels(rollouts: Path, labels: list[str], *, run: Path | None = None,
                      out: Path | None = None, human: str = "human", seed: int = 0,
                      draws: int = 1000, force: bool = False) -> StepLabelReport:
    """Where each credit source's push lands against the human step labels (SPEC §4) →
    ``out/step_label_audit.parquet`` (default: RUN/audit with ``run``, else DIR/audit);
    ``rollouts`` is an ingest folder (rollouts, steps and, if ingest wrote it, step_labels)."""
    from draco_cli.audit.labels_io import check_labels, message_steps, read_labels
    from draco_cli.audit.step_labels import RunCredit, step_label_audit
    from draco_cli.schemas import StepLabel, StepLabelFigure

    if draws < 1:
        raise UsageError(f"--bootstrap {draws}: give at least 1 draw")
    folder = Path(rollouts)
    if not folder.is_dir():
        raise UsageError(f"--rollouts {folder}: give the folder draco ingest wrote")
    out = Path(out) if out is not None else (Path(run) if run else folder) / "audit"
    r = read_table(folder / "rollouts.parquet", Rollout,
                   columns=["rollout_id", "group_id", "outcome"])
    steps = pl.read_parquet(folder / "steps.parquet", columns=["rollout_id", "step", "n_tokens"])
    frames = []
    own = folder / "step_labels.parquet"
    mapping: dict[tuple[str, int], int] = {}
    if own.is_file():
        own_labels = read_table(own, StepLabel)
        mapping = message_steps(own_labels)
        frames.append(read_labels(str(own), mapping))
    frames += [read_labels(spec, mapping) for spec in labels]
    if not frames:
        raise UsageError(f"--labels: {folder} has no step_labels.parquet; give the labels")
    all_labels = pl.concat(frames, how="vertical_relaxed")
    n_steps = dict(steps.group_by("rollout_id").agg(pl.col("step").max()).iter_rows())
    n_steps.update({x: 0 for x in r["rollout_id"].to_list() if x not in n_steps})
    check_labels(all_labels, n_steps)
    labelers = sorted(all_labels["labeler"].unique().to_list())
    if human not in labelers:
        raise UsageError(f"--human {human!r}: no labels from it (labelers: "
                         f"{', '.join(labelers)})")
    credit = None
    if run is not None:
        rf = RunFolder.open(Path(run))
        for name in ("rewards", "step_credit"):
            if not rf.has(name):
                raise UsageError(f"--run {run}: no {name} table (run the credit stage)")
        v = read_verdicts(rf.table("verdicts"), None, "--run") if rf.has("verdicts") else None
        credit = RunCredit(pl.read_parquet(rf.table("rewards")),
                           pl.read_parquet(rf.table("step_credit")), v)
        unknown = set(credit.rewards["rollout_id"].to_list()) - set(n_steps)
        if unknown:
            raise InputError(f"--run {run}: rollout {sorted(unknown)[0]!r} is not in "
                             f"{folder}: audit a run on the rollouts it scored",
                             file=str(rf.table("rewards")), field="rollout_id")
        if v is not None:
            assert rf.manifest is not None  # RunFolder.open read it
            credit.verdicts = credited_verdicts(v, r, rf.manifest.settings)
    _refuse_existing(out, ["step_label_audit"], force)
    figures = step_label_audit(steps, r, all_labels, human=human, run=credit, seed=seed,
                               draws=draws)
    t = publish_tables(out, {"step_label_audit": (figures, StepLabelFigure)}, force=force)
    return StepLabelReport(t["step_label_audit"], labelers,
                           all_labels.filter(pl.col("labeler") == human)["rollout_id"]
                           .n_unique(), out)
