"""The tables of replay (CREDO), audits, cost and evaluation."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import annotated_types
from pydantic import Field

from draco_cli.schemas.base import Int32, Table
from draco_cli.schemas.pipeline import TABLES

AllocationRule = Literal["sqrt", "uniform"]


Side = Literal["realized", "resampled"]


Probability = Annotated[float, annotated_types.Ge(0), annotated_types.Le(1)]


class ReplayPlan(Table):
    """`replay plan`: every position with its inclusion probability and selection, stored
    before any label exists (SPEC §6)."""

    table_name: ClassVar[str] = "replay_plan"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step")

    rollout_id: str = Field(description="The rollout.")
    step: int = Field(ge=1, description="1-based step t.")
    prediction: float = Field(description="c_t: the credit head's prediction, stored before "
                              "labels exist.")
    error: float = Field(ge=0, description="e_t: the predicted squared error of c_t.")
    score_norm: float = Field(ge=0, description="‖g_t‖ (1 when the trainer gives none).")
    n_steps: int | None = Field(None, ge=1, description="T: the rollout's number of steps "
                                   "(when the default cost was computed from it).")
    cost: float = Field(ge=0, description="ℓ_t: replay cost in environment actions "
                        "(default K·(T − t + 1) + K·(T − t)).")
    p: Probability = Field(description="p_t: inclusion probability (Eq. 10).")
    selected: bool = Field(description="S_t ~ Bernoulli(p_t) with the recorded seed.")
    lambda_: float = Field(alias="lambda", ge=0, description="λ of the allocation "
                           "(0: the budget was slack).")
    seed: int = Field(description="Seed of the Bernoulli selection.")
    head_version: str | None = Field(None, description="Version of the heads that made "
                                        "prediction and error (null: given by the user).")
    budget: float = Field(ge=0, description="The replay budget B.")
    expected_cost: float = Field(ge=0, description="Σ p_t ℓ_t: the plan's expected cost.")
    allocation: AllocationRule | None = Field(None, description="sqrt (Eq. 10) or uniform "
                                             "(one p at the same expected cost).")
    replays: int | None = Field(None, ge=1, description="K: replays per side.")


class ReplayLabel(Table):
    """`replay run`: one return of one replay (the labels `replay correct` reads)."""

    table_name: ClassVar[str] = "replay_labels"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step", "side", "sample")

    rollout_id: str = Field(description="The rollout.")
    step: int = Field(ge=1, description="1-based step t.")
    side: Side = Field(description="realized: restored after step t; resampled: restored "
                       "before step t with a fresh action.")
    sample: int | None = Field(None, ge=0, description="Index of the continuation on its "
                                  "side (0..K−1).")
    return_: float = Field(alias="return", description="The continuation's return.")


class ReplayCost(Table):
    """`replay run`: what replaying one position cost, as the environment reported it."""

    table_name: ClassVar[str] = "replay_cost"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step")

    rollout_id: str = Field(description="The rollout.")
    step: int = Field(ge=1, description="1-based step t.")
    env_actions: int = Field(ge=0, description="Environment actions the replays ran.")
    tokens: int = Field(ge=0, description="Policy tokens the replays generated.")
    reconstruction_actions: int = Field(ge=0, description="Actions spent restoring states.")
    reconstruction_tokens: int = Field(ge=0, description="Tokens spent restoring states.")
    seconds: float = Field(ge=0, description="Wall time of the request.")


class ReplayCredit(Table):
    """`replay correct`: corrected credit per position (Eq. 6) and its advantage."""

    table_name: ClassVar[str] = "replay_credit"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step")

    rollout_id: str = Field(description="The rollout.")
    step: int = Field(ge=1, description="1-based step t.")
    prediction: float = Field(description="c_t from the plan.")
    p: Probability = Field(description="p_t from the plan.")
    selected: bool = Field(description="S_t from the plan.")
    delta: float | None = Field(None, description="Δ_t = mean realized − mean resampled "
                                   "return (null where not replayed).")
    corrected: float = Field(description="Ĉ_t = c_t + (S_t/p_t)(Δ_t − c_t) (c_t with "
                             "--no-correction; clipped only with --clip).")
    rloo: float = Field(description="Unstandardized RLOO of the rollout's outcome (0 at β = 0).")
    advantage: float = Field(description="a_t = β·A_RLOO + (1 − β)·Ĉ_t.")
    settings: str = Field(description="JSON: correction, clip, beta, counts.")


class HeadPrediction(Table):
    """`replay fit --cross-fit`: cross-fitted predictions (a positions table for the next
    plan)."""

    table_name: ClassVar[str] = "head_predictions"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step")

    rollout_id: str = Field(description="The rollout.")
    step: int = Field(ge=1, description="1-based step t.")
    prediction: float = Field(description="c_t from heads fitted on the other folds.")
    error: float = Field(ge=0, description="e_t from the same heads.")
    fold: int = Field(ge=0, description="The position's fold (tasks split by hash).")
    head_version: str = Field(description="Version of the heads that predicted it.")


class AllocatorCalibration(Table):
    """`replay diagnose`: the e_t the allocator used vs realized (Δ_t − c_t)², per e-bin."""

    table_name: ClassVar[str] = "allocator_calibration"
    keys: ClassVar[tuple[str, ...]] = ("bin",)

    bin: int = Field(ge=0, description="Bin of e_t (by rank).")
    n: int = Field(ge=0, description="Replayed positions in the bin.")
    mean_predicted_error: float = Field(description="Inverse-inclusion-weighted mean e_t.")
    mean_squared_residual: float = Field(description="Inverse-inclusion-weighted mean "
                                         "(Δ_t − c_t)².")


class EvolveScore(Table):
    """`replay evolve` / `replay propose`: one rubric variant scored on held-out tasks."""

    table_name: ClassVar[str] = "evolve_scores"
    keys: ClassVar[tuple[str, ...]] = ("candidate",)

    candidate: str = Field(description="The variant: baseline / current rubric, or an edit.")
    held_out_objective: float | None = Field(
        None, ge=0, description="Σ (S/p)((1 − p)/p)‖g‖²(Δ − c)² on held-out tasks (lower is "
        "better; null when the edit could not be applied).")
    held_out_mse: float | None = Field(None, ge=0, description="Ordinary MSE of c on the "
                                          "same positions.")
    accepted: bool = Field(description="The accepted variant (at most one).")
    op: str | None = Field(None, description="propose: add, remove or merge.")
    title: str | None = Field(None, description="propose: the new criterion's title.")
    reason: str | None = Field(None, description="propose: why the LLM proposed it.")
    outcome_auc: float | None = Field(None, ge=0, le=1, description="propose: AUC of the "
                                         "rollout reward for the environment outcome.")
    criteria: int | None = Field(None, ge=0, description="propose: criteria in the rubric.")
    error: str | None = Field(None, description="propose: why the edit was not scored.")
    train_rows: int | None = Field(None, ge=0, description="evolve: labelled training "
                                      "positions.")
    held_out_rows: int | None = Field(None, ge=0, description="evolve: labelled held-out "
                                         "positions.")


REPLAY_TABLES: tuple[type[Table], ...] = (ReplayPlan, ReplayLabel, ReplayCost, ReplayCredit,
                                          HeadPrediction, AllocatorCalibration, EvolveScore)


TABLES.update({m.table_name: m for m in REPLAY_TABLES})


Share = Annotated[float, annotated_types.Ge(0.0), annotated_types.Le(1.0)]


Count = Annotated[int, annotated_types.Ge(0)]


class Agreement(Table):
    """``draco audit self-judge``: agreement of a self-judge with a reference, per scope."""

    table_name: ClassVar[str] = "agreement"
    keys: ClassVar[tuple[str, ...]] = ("scope",)

    scope: str = Field(description="overall, step:N, first_quarter or last_quarter.")
    n_rows: Count = Field(description="(rollout, criterion) pairs judged by both judges.")
    agreement: Share | None = Field(None, description="Share of pairs where the verdicts "
                                       "agree (an unanswered self verdict disagrees).")
    pass_all_baseline: Share | None = Field(
        None, description="Agreement of a judge that passes everything (the reference's pass "
        "share).")
    false_pass_rate: Share | None = Field(
        None, description="Self passes among the reference's fails.")
    false_fail_rate: Share | None = Field(
        None, description="Self fails among the reference's passes.")
    leniency_ratio: float | None = Field(
        None, ge=0, description="False passes over false fails; null without false fails.")
    unanswered_rate: Share | None = Field(None, description="Self verdicts left unanswered.")
    criteria_per_rollout: float | None = Field(
        None, ge=0, description="Mean criteria judged per rollout.")
    reference_fail_share: Share | None = Field(
        None, description="Share of the reference's verdicts that are fail.")


class AgreementTest(Table):
    """``draco audit self-judge``: significance tests of drift over training steps."""

    table_name: ClassVar[str] = "tests"
    keys: ClassVar[tuple[str, ...]] = ("metric", "test")

    metric: str = Field(description="The agreement figure tested (agreement, false_pass_rate, "
                        "...).")
    test: str = Field(description="welch_t_first_vs_last_quarter (per-step rates of the "
                      "first vs last quarter of steps) or wls_trend_per_step (slope of the "
                      "per-step rate on train_step, weighted by rows).")
    statistic: float | None = Field(None, description="The test's t statistic; null when "
                                       "it cannot be computed.")
    p_value: Share | None = Field(None, description="Two-sided p-value; null when the test "
                                     "cannot be computed.")
    n_steps: Count | None = Field(None, description="Train steps the test is over (each one "
                                     "observation).")


class OverlapTest(AgreementTest):
    """``draco audit overlap``: step-level trend tests of recall and precision."""

    table_name: ClassVar[str] = "overlap_tests"


class Overlap(Table):
    """``draco audit overlap``: recall and precision of a rubric writer against a reference."""

    table_name: ClassVar[str] = "overlap"
    keys: ClassVar[tuple[str, ...]] = ("scope",)

    scope: str = Field(description="overall, step:N, or ceiling (the reference against "
                       "itself across units of one task).")
    units: Count = Field(description="Groups (or rollouts, --level rollout) compared.")
    own_criteria: Count = Field(description="Criteria of the own rubric writer.")
    reference_criteria: Count = Field(description="Criteria of the reference.")
    matched: Count = Field(description="Criteria matched one-to-one.")
    recall: Share | None = Field(None, description="matched / reference_criteria.")
    precision: Share | None = Field(None, description="matched / own_criteria.")


class OverlapUnit(Table):
    """``draco audit overlap``: the match counts of each unit (group or rollout)."""

    table_name: ClassVar[str] = "overlap_units"
    keys: ClassVar[tuple[str, ...]] = ("unit",)

    unit: str = Field(description="group_id (--level group) or rollout_id (--level rollout).")
    n_own: Count = Field(description="Own criteria of the unit.")
    n_reference: Count = Field(description="Reference criteria of the unit.")
    matched: Count = Field(description="Criteria matched one-to-one.")
    task_id: str | None = Field(None, description="The unit's task (with --rollouts).")
    train_step: Int32 | None = Field(None, description="The unit's train step (with "
                                        "--rollouts).")


class RubricSummary(Table):
    """``draco audit rubric``: one row of rubric statistics."""

    table_name: ClassVar[str] = "rubric_summary"
    keys: ClassVar[tuple[str, ...]] = ()

    criteria: Count = Field(description="Criteria in the rubrics table.")
    groups: Count = Field(description="Groups with a rubric.")
    criteria_per_group: float | None = Field(None, ge=0, description="criteria / groups.")
    discriminative_share: Share | None = Field(
        None, description="Judged criteria that some rollout failed.")
    distinct_criteria: Count = Field(description="Distinct criterion texts (normalised).")
    single_task_share: Share | None = Field(
        None, description="Distinct criteria used by one task only.")
    single_task_judgment_share: Share | None = Field(
        None, description="Judgments made against single-task criteria.")
    verdict_failure_share: Share | None = Field(
        None, description="fail among pass and fail verdicts.")
    na_rate: Share | None = Field(None, description="na among all judgments.")


class RubricCriterionStats(Table):
    """``draco audit rubric``: judgments of each criterion, worst na rate first."""

    table_name: ClassVar[str] = "rubric_criteria"
    keys: ClassVar[tuple[str, ...]] = ("group_id", "criterion_id")

    group_id: str = Field(description="The criterion's group.")
    criterion_id: str = Field(description="The criterion.")
    title: str = Field(description="Its title.")
    requirement: str = Field(description="Its requirement.")
    judgments: Count = Field(description="Verdicts given on it.")
    fails: Count = Field(description="fail verdicts.")
    passes: Count = Field(description="pass verdicts.")
    nas: Count = Field(description="na verdicts.")
    na_rate: Share | None = Field(None, description="nas / judgments.")
    discriminative: bool = Field(description="Some rollout failed it.")
    single_task: bool | None = Field(None, description="Its text is used by one task only.")


class CostPhase(Table):
    """``draco audit cost``: calls, tokens and dollars per LLM phase."""

    table_name: ClassVar[str] = "cost_phase"
    keys: ClassVar[tuple[str, ...]] = ("phase",)

    phase: str = Field(description="generate, union, merge, score, ...")
    calls: Count = Field(description="Requests sent (cached answers are not requests).")
    answered: Count = Field(description="Calls answered.")
    input_tokens: Count = Field(description="Prompt tokens.")
    cached_tokens: Count = Field(description="Prompt tokens the provider served from its cache.")
    output_tokens: Count = Field(description="Answer tokens.")
    reasoning_tokens: Count = Field(description="Thinking tokens (part of output_tokens).")
    cost_usd: float | None = Field(None, ge=0, description="Dollars; null if unpriced.")


class CostStep(Table):
    """``draco audit cost``: calls, tokens and dollars per train step."""

    table_name: ClassVar[str] = "cost_step"
    keys: ClassVar[tuple[str, ...]] = ("train_step",)

    train_step: Int32 | None = Field(None, description="The train step; null for calls of "
                                        "no known step.")
    # the counts are absent (null) when no call could be tied to a step: the table is empty
    calls: Count | None = Field(None, description="Requests sent.")
    input_tokens: Count | None = Field(None, description="Prompt tokens.")
    cached_tokens: Count | None = Field(
        None, description="Prompt tokens served from the provider's cache.")
    output_tokens: Count | None = Field(None, description="Answer tokens.")
    reasoning_tokens: Count | None = Field(None, description="Thinking tokens.")
    cost_usd: float | None = Field(None, ge=0, description="Dollars; null if unpriced.")


class CostCategory(Table):
    """``draco audit cost``: tokens, environment actions and dollars by what they paid for."""

    table_name: ClassVar[str] = "cost_category"
    keys: ClassVar[tuple[str, ...]] = ("category",)

    category: str = Field(description="original, replay, reconstruction, judge, rubric writing "
                          "or candidate scoring.")
    tokens: Count | None = Field(None, description="Tokens (generated or read).")
    env_actions: Count | None = Field(None, description="Environment actions taken.")
    llm_calls: Count | None = Field(None, description="LLM requests.")
    cost_usd: float | None = Field(None, ge=0, description="Dollars; null if unpriced.")


class CostNaive(Table):
    """``draco audit cost``: billed tokens and dollars per phase (and ``all``) next to what a
    naive client would have paid: one call per sample, no prompt caching, no batch discount.
    Each phase has a row per route (``online``, ``batch``: calls sent through a provider's
    batch API, logged with their ``batch_id``) and ``all`` for both."""

    table_name: ClassVar[str] = "cost_naive"
    keys: ClassVar[tuple[str, ...]] = ("phase", "route")

    phase: str = Field(description="The LLM phase, or all.")
    route: Literal["online", "batch", "all"] = Field(
        description="online, batch (through a batch API: half price), or all.")
    calls: Count = Field(description="Requests billed (one n-choice reply is one request).")
    naive_calls: Count = Field(description="Requests a naive client sends: one per sample.")
    input_tokens: Count = Field(description="Uncached prompt tokens billed.")
    cached_tokens: Count = Field(description="Prompt tokens read from the provider's cache.")
    cache_write_tokens: Count = Field(description="Prompt tokens written to the cache "
                                      "(Anthropic).")
    output_tokens: Count = Field(description="Answer tokens.")
    naive_input_tokens: Count = Field(description="Prompt tokens a naive client pays in full.")
    batch_share: float | None = Field(None, ge=0, le=1, description="Share of the rows sent "
                                         "through a batch API.")
    billed_usd: float | None = Field(None, ge=0, description="Dollars billed; null if "
                                        "unpriced.")
    naive_usd: float | None = Field(None, ge=0, description="Dollars a naive client pays; "
                                       "null if unpriced.")
    billed_over_naive: float | None = Field(None, ge=0, description="billed_usd / naive_usd.")
    unpriced_rows: Count = Field(description="Rows of models without a price, left out of the "
                                 "dollars.")


class StepLabelFigure(Table):
    """``draco audit step-labels``: one figure of one credit source against the human step
    labels (SPEC §4, step-label audit)."""

    table_name: ClassVar[str] = "step_label_audit"
    keys: ClassVar[tuple[str, ...]] = ("source", "figure")

    source: str = Field(description="run, uniform, labels:NAME (a labeler's labels as "
                        "verdicts; labels:human is the ceiling) or random_citation.")
    figure: str = Field(description="auroc_quality, bad_mass, good_mass or worst_step_hit.")
    value: float | None = Field(None, description="The figure; null when undefined.")
    ci_low: float | None = Field(None, description="2.5th percentile of the group bootstrap.")
    ci_high: float | None = Field(None, description="97.5th percentile of the group "
                                     "bootstrap.")
    uniform: float | None = Field(None, description="The figure under uniform credit (0.5 for "
                                     "AUROC; the token share of the labelled steps for the "
                                     "masses; the −1 share of labelled steps for worst_step_hit).")
    lift: float | None = Field(None, description="value / uniform.")
    n: Count = Field(description="Labelled ±1 steps (AUROC) or rollouts the figure is over.")
    n_groups: Count = Field(description="Groups contributing.")
    zero_advantage_rollouts: Count = Field(description="Audited rollouts with A_i = 0 "
                                           "(counted, in no mass figure).")


class Metric(Table):
    """``draco eval``: one figure of one scope (long form)."""

    table_name: ClassVar[str] = "metrics"
    keys: ClassVar[tuple[str, ...]] = ("scope", "metric", "k")

    scope: str = Field(description="overall, or COLUMN=VALUE for --by and train_step scopes.")
    metric: str = Field(description="tgc, sgc, pass_hat_k, pass_at_k, sgc_hat_k, retention, "
                        "sgc_retention, mean_turns or termination:MODE.")
    k: int | None = Field(None, ge=1, description="k of the k-metrics; null otherwise.")
    value: float | None = Field(None, description="The figure; null when it cannot be "
                                   "computed (e.g. no task with k trials).")
    n: Count | None = Field(None, description="Tasks (or rollouts, for mean_turns and "
                               "terminations) the figure is taken over.")


OUTPUT_TABLES: dict[str, type[Table]] = {
    m.table_name: m
    for m in (Agreement, AgreementTest, Overlap, OverlapUnit, RubricSummary,
              RubricCriterionStats, CostPhase, CostStep, CostCategory, CostNaive, Metric,
              StepLabelFigure, OverlapTest)
}


TABLES.update(OUTPUT_TABLES)
