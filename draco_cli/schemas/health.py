"""The tables of ``draco audit judge-health``: per step, per criterion and step, and trends."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from draco_cli.schemas.results import OUTPUT_TABLES, Count, Share
from draco_cli.schemas.pipeline import TABLES
from draco_cli.schemas.base import Table


class JudgeHealthStep(Table):
    """``draco audit judge-health``: one train step, over every criterion."""

    table_name: ClassVar[str] = "judge_health_steps"
    keys: ClassVar[tuple[str, ...]] = ("train_step",)

    train_step: int = Field(ge=0, description="The run folder's train step.")
    rollouts: Count = Field(description="Rollouts of the step.")
    outcome_n: Count = Field(description="Rollouts with an outcome.")
    outcome_rate: Share | None = Field(None, description="Mean outcome of those rollouts.")
    verdicts: Count = Field(description="Pass and fail verdicts (na and unanswered left out).")
    pass_rate: Share | None = Field(None, description="Passes / (passes + fails), all "
                                    "criteria.")
    criteria: Count = Field(description="Distinct criteria (by the --match key).")
    mean_reward: float | None = Field(None, description="Mean rubric reward.")
    pairs: Count = Field(description="Within-group pairs of rollouts with different outcomes.")
    agreement: Share | None = Field(None, description="Share of those pairs the reward orders "
                                    "as the outcome does (ties half; 0.5 is chance).")
    correlation: float | None = Field(None, ge=-1, le=1, description="Pearson's r of reward "
                                      "and outcome; null when either is constant.")
    spot_n: Count = Field(0, description="Spot-checked verdicts the gold judge answered "
                          "(draco run --spot-check); 0 without spot checks.")
    spot_agreement: Share | None = Field(None, description="Share of them on which the "
                                         "training and gold judges give the same verdict.")
    spot_kappa: float | None = Field(None, ge=-1, le=1, description="Cohen's kappa of the two "
                                     "judges' verdicts (pass, fail, na); null when undefined.")
    spot_judge_pass_rate: Share | None = Field(None, description="The training judge's pass "
                                               "rate on those verdicts (na left out).")
    spot_gold_pass_rate: Share | None = Field(None, description="The gold judge's pass rate "
                                              "on them (na left out).")


class JudgeHealthCriterion(Table):
    """``draco audit judge-health``: one criterion at one train step."""

    table_name: ClassVar[str] = "judge_health_criteria"
    keys: ClassVar[tuple[str, ...]] = ("criterion", "train_step")

    criterion: str = Field(description="The key matching criteria across steps: the "
                           "normalised title (--match title) or the criterion id (--match id).")
    title: str = Field(description="The criterion's title as written (its id without one).")
    train_step: int = Field(ge=0, description="The train step.")
    groups: Count = Field(description="Groups the criterion was judged in.")
    n: Count = Field(description="Pass and fail verdicts.")
    passes: Count = Field(description="Pass verdicts.")
    na: Count = Field(description="na verdicts.")
    unanswered: Count = Field(description="Verdicts left unanswered.")
    pass_rate: Share | None = Field(None, description="passes / n.")
    outcome_rate: Share | None = Field(None, description="Mean outcome of the rollouts behind "
                                       "those n verdicts.")
    pass_rate_success: Share | None = Field(None, description="Pass rate on rollouts with "
                                            "outcome 1.")
    pass_rate_failure: Share | None = Field(None, description="Pass rate on rollouts with "
                                            "outcome 0.")


class JudgeHealthTrend(Table):
    """``draco audit judge-health``: the trends of the run's aggregate and of each criterion,
    and whether the pass rate rises while the outcome does not."""

    table_name: ClassVar[str] = "judge_health_trends"
    keys: ClassVar[tuple[str, ...]] = ("scope", "criterion")

    scope: Literal["run", "criterion", "spot_check"] = Field(
        description="run (all criteria), criterion, or spot_check (the training judge "
        "against the gold judge of draco run --spot-check).")
    criterion: str | None = Field(None, description="The criterion key; null for the run.")
    title: str | None = Field(None, description="The criterion's title.")
    n_steps: Count = Field(description="Train steps with verdicts (each one observation).")
    pass_rate_first: Share | None = Field(None, description="Pass rate at the first step.")
    pass_rate_last: Share | None = Field(None, description="Pass rate at the last step.")
    pass_slope: float | None = Field(None, description="WLS slope of the per-step pass rate "
                                     "on train_step (weights: verdicts).")
    pass_t: float | None = Field(None, description="Its t statistic (S − 2 df); null when "
                                 "undefined or infinite (a perfect fit).")
    pass_p: Share | None = Field(None, description="Its two-sided p-value.")
    pass_p_holm: Share | None = Field(None, description="Holm-adjusted over the criteria "
                                      "tested (criteria only).")
    outcome_slope: float | None = Field(None, description="WLS slope of the per-step outcome "
                                        "rate of the same rollouts.")
    outcome_p: Share | None = Field(None, description="Its two-sided p-value.")
    agreement_slope: float | None = Field(None, description="WLS slope of the per-step "
                                          "reward-outcome agreement (run), or of the "
                                          "agreement with the gold judge (spot_check).")
    agreement_p: Share | None = Field(None, description="Its two-sided p-value (run, "
                                      "spot_check).")
    flagged: bool = Field(description="Pass rate rises (slope > 0, p < alpha; Holm for "
                          "criteria) over ≥ min-steps steps while the outcome does not "
                          "(slope ≤ 0 or p ≥ alpha); spot_check: the agreement with the gold "
                          "judge falls (slope < 0, p < alpha) while the pass rate rises.")
    reason: str = Field(description="The figures behind the flag, in words.")


HEALTH_TABLES: dict[str, type[Table]] = {
    m.table_name: m for m in (JudgeHealthStep, JudgeHealthCriterion, JudgeHealthTrend)}
OUTPUT_TABLES.update(HEALTH_TABLES)
TABLES.update(HEALTH_TABLES)
