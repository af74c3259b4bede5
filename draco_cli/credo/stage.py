"""The `draco replay` operations (CREDO, SPEC §6): each reads its inputs, calls the pure
functions of ``draco_cli.credo`` and writes its outputs against their contracts and as output
sets (docs/credo.md, "Outputs: contracts and output sets"). Nothing here prints or exits; the
command layer (``draco_cli.cli.replay``) does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

import polars as pl

from draco_cli.credo import (Heads, correct, cross_fit, draco_features, evolve, fit_heads,
                             fit_with_holdout, plan, rollout_lengths)
from draco_cli.credo.protocol import LOG_NAME, RunResult, run_replays
from draco_cli.errors import UsageError, naming
from draco_cli.publish import publish_tables
from draco_cli.io import (OutputSet, check_writable, conform, folder_lock, prepare_out_dir,
                          as_frame, read_arrow, require_finite, write_table, write_text_atomic)
from draco_cli.schemas import (AllocatorCalibration, EvolveScore, HeadPrediction, ReplayCost,
                               ReplayCredit, ReplayLabel, ReplayPlan, Rollout, Rubric, Step,
                               TokenAdvantages, VerdictAggregated)

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings

PathLike = str | Path

# The files of each multi-table output (one output set per folder).
RUN_TABLES = ("labels.parquet", "replay_cost.parquet")
CORRECT_TABLES = ("credit.parquet", "token_advantages.parquet")
PROPOSE_TABLES = ("evolve.parquet", "rubrics.parquet", "verdicts.parquet")
DIAGNOSE_FILES = ("diagnostics.json", "allocator_calibration.parquet")
PROPOSE_CALL_LOG = "llm_calls.sqlite"
TOKEN_ROLLOUT_COLUMNS = ("rollout_id", "response_len", "policy_spans", "train_step",
                         "response_fingerprint")
TOKEN_STEP_COLUMNS = ("rollout_id", "step", "n_tokens", "token_start")


def read(path: PathLike) -> pl.DataFrame:
    return as_frame(read_arrow(path))


def read_plan(path: PathLike, *also: str) -> pl.DataFrame:
    """A plan with its position and selection columns (and ``also``) held to the contract:
    a table that is not a plan is named, file and column."""
    return conform(read(path), ReplayPlan, str(path), ["rollout_id", "step", "selected", *also],
                   check_keys=False)


def read_labels(path: PathLike) -> pl.DataFrame:
    return conform(read(path), ReplayLabel, str(path), ["rollout_id", "step", "side", "return"],
                   check_keys=False)


def features_table(path: PathLike, rewards: PathLike | None = None) -> pl.DataFrame:
    """A features table: a step_credit table becomes DRACO features (with the reward feature
    when `rewards` is given); any other table is taken as rollout_id, step, numeric columns."""
    F = read(path)
    if {"p", "f", "quality", "cited", "n_tokens"} <= set(F.columns):
        return draco_features(F, read(rewards) if rewards else None)
    return F


# --- plan ---------------------------------------------------------------------------------


def plan_replay(positions: PathLike, budget: float, out: PathLike, *, p_min: float = 0.05,
                seed: int = 0, replays: int = 2, steps: PathLike | None = None,
                allocation: str = "sqrt", heads: PathLike | None = None,
                features: PathLike | None = None, rewards: PathLike | None = None,
                force: bool = False) -> pl.DataFrame:
    """`replay plan`: the plan (SPEC §6), predictions from `heads` when given, → `out`."""
    check_writable(out, force)
    if heads is not None and features is None:
        raise UsageError("--heads needs --features")
    pos = read(positions)
    with naming(steps):
        lengths = rollout_lengths(read(steps)) if steps is not None else None
    version = None
    if heads is not None:
        assert features is not None
        h = Heads.from_json(Path(heads).read_text(), str(heads))
        F = features_table(features, rewards)
        own = [c for c in ("score_norm", "cost", "n_steps") if c in pos.columns]
        # the positions' own columns win over a features table's (no `_right` copies)
        joined = pos.select("rollout_id", pl.col("step").cast(pl.Int64), *own).join(
            F.drop(own, strict=False), on=["rollout_id", "step"], how="left",
            maintain_order="left")
        c, e = h.predict(joined)
        pos = joined.with_columns(pl.Series("prediction", c), pl.Series("error", e))
        version = h.version
    with naming(positions):
        result = plan(pos, budget, p_min=p_min, seed=seed, replays=replays,
                      head_version=version, n_steps=lengths, allocation=allocation)
    # every table is checked against its contract before it is written: a broken one is an
    # error naming the output, never a file
    result = conform(result, ReplayPlan, str(out))
    write_table(result, out, ReplayPlan, force=force)
    return result


# --- run ------------------------------------------------------------------------------------


def run_replay(plan_path: PathLike, env: str, out: PathLike, *, workers: int = 2,
               replays: int | None = None, timeout: float = 600.0, force: bool = False,
               progress: Callable[[int, int], None] | None = None) -> RunResult:
    """`replay run`: every selected position of the plan replayed by the environment `env`
    (locking and resume: docs/credo.md, "The replay protocol"). `result.labels` is None unless
    every selected position has its answer."""
    folder = prepare_out_dir(out)
    with folder_lock(folder):
        check_writable(folder / RUN_TABLES[0], force)
        res = run_replays(read_plan(plan_path), env, folder / LOG_NAME, workers=workers,
                          replays=replays, replace_other=force, timeout=timeout,
                          progress=progress)
        if res.labels is not None:
            publish_tables(folder, {"labels": (res.labels, ReplayLabel),
                                    "replay_cost": (res.costs, ReplayCost)}, force=True)
    return res


# --- correct --------------------------------------------------------------------------------


def correct_replay(plan_path: PathLike, labels: PathLike, out: PathLike, *, beta: float = 0.0,
                   rollouts: PathLike | None = None, steps: PathLike | None = None,
                   no_correction: bool = False, clip: float | None = None,
                   force: bool = False) -> dict[str, Any]:
    """`replay correct`: corrected credit → OUT/credit.parquet, and with `steps` token
    advantages → OUT/token_advantages.parquet, one output set. Returns the settings/counts."""
    from draco_cli.credo.tokens import credo_token_advantages

    if steps is not None and rollouts is None:
        raise UsageError("--steps needs --rollouts")
    names = [CORRECT_TABLES[0]] + ([CORRECT_TABLES[1]] if steps is not None else [])
    folder = Path(out)
    for name in names:
        check_writable(folder / name, force)
    r = read(rollouts) if rollouts else None
    plan_df, labels_df = read_plan(plan_path, "prediction", "p"), read_labels(labels)
    for df, cols, src in ((plan_df, ("prediction", "p"), plan_path),
                          (labels_df, ("return",), labels), (r, ("outcome",), rollouts)):
        if df is not None:
            require_finite(df, cols, str(src))
    credit, info = correct(plan_df, labels_df, beta=beta, rollouts=r,
                           no_correction=no_correction, clip=clip)
    credit = conform(credit.with_columns(pl.lit(json.dumps(info)).alias("settings")),
                     ReplayCredit, str(folder / names[0]))
    ta = None
    if steps is not None:
        assert r is not None and rollouts is not None
        # the columns the token layout reads, checked against their contracts (the optional
        # ones a table lacks come in as null, as in credit compute)
        r_tok = conform(r, Rollout, str(rollouts), only=list(TOKEN_ROLLOUT_COLUMNS),
                        check_keys=False)
        s_tok = conform(read(steps), Step, str(steps), only=list(TOKEN_STEP_COLUMNS),
                        check_keys=False)
        ta = credo_token_advantages(r_tok, s_tok, credit, beta)
    with OutputSet(folder, names, force=force) as output:
        output.write_table(credit, names[0], ReplayCredit)
        if ta is not None:
            output.write_table(ta, names[1], TokenAdvantages, drop_absent_optional=True)
    return info


# --- fit ------------------------------------------------------------------------------------


@dataclass
class FitResult:
    heads: Heads
    calibration: pl.DataFrame | None  # held-out calibration (with rollouts), else None
    note: str                         # what was held out, or why there is no calibration
    cross_fitted: pl.DataFrame | None = None


def fit_replay(plan_path: PathLike, labels: PathLike, features: PathLike, out: PathLike, *,
               rewards: PathLike | None = None, rollouts: PathLike | None = None,
               ridge: float = 1.0, holdout: float = 0.2, folds: int | None = None,
               predictions: PathLike | None = None, force: bool = False) -> FitResult:
    """`replay fit`: the heads → `out` (JSON); with `folds`, cross-fitted predictions →
    `predictions`. Everything is computed before anything is written."""
    if not ridge >= 0:
        raise UsageError(f"--ridge {ridge:g}: give a penalty of 0 or more")
    if not 0 < holdout < 1:
        raise UsageError(f"--holdout {holdout:g}: give the share of tasks held out, between 0 "
                         "and 1")
    if folds is not None and (rollouts is None or predictions is None):
        raise UsageError("--cross-fit needs --rollouts (for the folds by task) and "
                         "--predictions (where to write them)")
    check_writable(out, force)
    if predictions is not None and folds is not None:
        check_writable(predictions, force)
    F = features_table(features, rewards)
    P, L = read_plan(plan_path), read_labels(labels)
    R = read(rollouts) if rollouts is not None else None
    if R is not None:
        h, cal, note = fit_with_holdout(P, L, F, R, ridge, holdout)
    else:
        h, cal, note = fit_heads(P, L, F, ridge), None, \
            "no calibration table: pass --rollouts to hold out tasks for it"
    cf = None
    if folds is not None:
        assert R is not None and predictions is not None
        cf = conform(cross_fit(P, L, F, R, folds, ridge), HeadPrediction, str(predictions))
        write_table(cf, predictions, HeadPrediction, force=force)
    write_text_atomic(out, h.to_json(), force=force)
    return FitResult(h, cal, note, cf)


# --- evolve / propose -----------------------------------------------------------------------


def evolve_replay(plan_path: PathLike, labels: PathLike, rollouts: PathLike,
                  baseline: PathLike, candidates: Sequence[PathLike], out: PathLike, *,
                  ridge: float = 1.0, holdout: float = 0.2, force: bool = False
                  ) -> pl.DataFrame:
    """`replay evolve`: rubric variants (feature tables) scored on held-out tasks → `out`."""
    check_writable(out, force)
    cands = {"baseline": features_table(baseline)}
    for p in candidates:
        cands[Path(p).stem] = features_table(p)
    scores = evolve(read_plan(plan_path), read_labels(labels), read(rollouts), cands, ridge, holdout)
    write_table(conform(scores, EvolveScore, str(out)), out, EvolveScore, force=force)
    return scores


@dataclass
class ProposeResult:
    scores: pl.DataFrame
    accepted: str | None
    notes: list[str]
    llm_stats: dict[str, Any] = field(default_factory=dict)  # phase → calls and cost


def propose_replay(plan_path: PathLike, labels: PathLike, rollouts: PathLike, steps: PathLike,
                   rubrics: PathLike, verdicts: PathLike, out: PathLike, llm: LLMSettings, *,
                   max_edits: int = 3, evidence: int = 8, ridge: float = 1.0,
                   holdout: float = 0.2, force: bool = False,
                   progress: Callable[..., None] | None = None) -> ProposeResult:
    """`replay propose`: LLM-proposed rubric edits scored on held-out tasks → OUT/evolve,
    rubrics, verdicts (one output set); calls cached in OUT/llm_calls.sqlite. `llm` is an
    ``LLMSettings``. The folder is locked while the calls run (docs/decisions.md, "CREDO as a
    package")."""
    from draco_cli.credo.propose import evolve_round
    from draco_cli.llm import CallLog

    folder = prepare_out_dir(out)
    with folder_lock(folder):
        for name in PROPOSE_TABLES:
            check_writable(folder / name, force)
        with CallLog(folder / PROPOSE_CALL_LOG) as log:
            client = llm.client(log)
            res = evolve_round(read_plan(plan_path), read_labels(labels), read(rollouts), read(steps),
                               read(rubrics), read(verdicts), client, max_edits=max_edits,
                               evidence=evidence, ridge=ridge, holdout=holdout,
                               progress=progress)
        publish_tables(folder, {"evolve": (res.scores, EvolveScore),
                                "rubrics": (res.rubrics, Rubric),
                                "verdicts": (res.verdicts, VerdictAggregated)}, force=True)
    return ProposeResult(res.scores, res.accepted, res.notes, dict(client.stats))


# --- diagnose -------------------------------------------------------------------------------


@dataclass
class Diagnostics:
    report: dict[str, Any]                # section → figures (diagnostics.json)
    calibration: pl.DataFrame | None      # allocator calibration (with labels)


def diagnose_replay(plan_path: PathLike, *, labels: PathLike | None = None,
                    heads: Sequence[PathLike] | None = None, features: PathLike | None = None,
                    rewards: PathLike | None = None, out: PathLike | None = None,
                    force: bool = False) -> Diagnostics:
    """`replay diagnose`: weight tails, variance split, allocator calibration and, given two
    heads, predictor drift; → OUT/diagnostics.json and OUT/allocator_calibration.parquet (one
    output set) when `out` is given."""
    from draco_cli.credo.diagnostics import (allocator_calibration, predictor_drift,
                                             variance_split, weight_tails)

    if heads and (len(heads) != 2 or features is None):
        raise UsageError("predictor drift takes --heads OLD --heads NEW and --features")
    P = read_plan(plan_path)
    report: dict[str, Any] = {"weights": weight_tails(P)}
    cal = None
    if labels is not None:
        L = read_labels(labels)
        report["variance_split"] = variance_split(P, L)
        cal = allocator_calibration(P, L)
    if heads:
        assert features is not None
        old, new = (Heads.from_json(Path(h).read_text(), str(h)) for h in heads)
        report["drift"] = predictor_drift(old, new, features_table(features, rewards))
    if out is not None:
        names = [DIAGNOSE_FILES[0]] + ([DIAGNOSE_FILES[1]] if cal is not None else [])
        with OutputSet(out, names, force=force) as output:
            output.write_text(names[0], json.dumps(report, indent=2))
            if cal is not None:
                output.write_table(conform(cal, AllocatorCalibration, str(Path(out) / names[1])),
                                   names[1], AllocatorCalibration)
    return Diagnostics(report, cal)


# --- exact check ----------------------------------------------------------------------------


def exact_check_rows(replays: int = 2, p_min: float = 0.05,
                     sweep: list[int] | None = None) -> list[dict[str, Any]]:
    """`replay exact-check`: the exact enumeration's rows (and the sweep over M, if asked)."""
    from draco_cli.credo.exact_check import exact_check, sweep_replays

    if sweep is not None and (not sweep or min(sweep) < 1):
        raise UsageError("--sweep-replays takes positive integers, e.g. 1,2,4")
    rows = exact_check(M=replays, p_min=p_min)
    return rows + sweep_replays(sweep, p_min) if sweep is not None else rows
