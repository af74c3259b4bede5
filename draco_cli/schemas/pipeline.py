"""The pipeline's tables: rollouts and steps, rubrics, verdicts, rewards, step credit, token advantages."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from draco_cli.schemas.base import (
    MAX_TOKENS,
    CreditMode,
    Float32,
    Int32,
    StepNumber,
    Table,
    Termination,
    Verdict,
)


class Rollout(Table):
    """One logged episode of an agent on a task."""

    table_name: ClassVar[str] = "rollouts"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id",)

    rollout_id: str = Field(description="Unique id of the rollout.")
    group_id: str = Field(
        description="Rollouts sampled together for one task (one GRPO group); "
        "default task_id, or task_id/train_step when train_step is set."
    )
    task_id: str = Field(description="The task this rollout attempts.")
    train_step: Int32 | None = Field(None, description="RL training step that produced it.")
    trial: Int32 | None = Field(
        None, description="Index of this attempt at the task; pairs the tasks of a scenario."
    )
    scenario_id: str | None = Field(None, description="Scenario (AppWorld groups 3 tasks).")
    difficulty: str | None = Field(None, description="Difficulty label, if the benchmark has one.")
    instruction: str = Field(description="The task text.")
    outcome: float | None = Field(
        None, description="The environment's terminal evaluator; 1 = success."
    )
    termination: Termination | None = Field(None, description="What ended the episode.")
    termination_raw: str | None = Field(
        None, description="The log's own word for what ended the episode, before mapping."
    )
    n_turns: Int32 = Field(ge=0, description="Policy (assistant) messages in the episode.")
    response_len: Int32 | None = Field(
        None,
        ge=0,
        le=MAX_TOKENS,
        description="Tokens of the trainer's response sequence, observation and gap tokens "
        "included.",
    )
    policy_spans: list[list[Int32]] | None = Field(
        None,
        description="Half-open [start, end) token ranges the policy generated: exactly where "
        "the trainer's response_mask is 1.",
    )
    response_fingerprint: str | None = Field(
        None, description="Hash of the trainer's response token ids, when ingest took positions "
        "from them (draco_cli.trainers.loader.fingerprint); copied into token_advantages.")
    task_context: str | None = Field(
        None, description="What the agent was told besides the task: its policy or system "
        "prompt (tau-bench's wiki, tau2's domain policy). The rubric writer and the judge see "
        "it before everything else in their prompts, so providers cache it as a prefix.")


class Step(Table):
    """One step of a rollout, in the step unit recorded in the ingest manifest."""

    table_name: ClassVar[str] = "steps"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step")

    rollout_id: str = Field(description="The rollout this step belongs to.")
    step: Int32 = Field(ge=1, description="1-based step number, contiguous within a rollout.")
    action: str = Field(description="The step's text (message text, code block or tool call).")
    observation: str = Field(description="What came back before the next step.")
    n_tokens: Int32 = Field(ge=1, le=MAX_TOKENS,
                            description="The step's tokens in the trainer's tokenizer.")
    token_start: Int32 | None = Field(
        None, ge=0, le=MAX_TOKENS,
        description="Offset of the step's first token in the response sequence."
    )


class RubricCandidate(Table):
    """A criterion proposed by rubric stage 1 (generate) or 2 (union)."""

    table_name: ClassVar[str] = "rubric_candidates"
    keys: ClassVar[tuple[str, ...]] = ("group_id", "candidate_id")

    group_id: str = Field(description="Group the candidate was written for.")
    candidate_id: str = Field(description="Id of the candidate within its group.")
    stage: Literal["generate", "union"] = Field(description="Rubric stage that proposed it.")
    origin_rollout_id: str | None = Field(
        None, description="Rollout shown to the generator (stage generate)."
    )
    title: str = Field(description="Short title.")
    requirement: str = Field(description="One sentence: what passing means.")


class Rubric(Table):
    """A criterion of a group's final rubric."""

    table_name: ClassVar[str] = "rubrics"
    keys: ClassVar[tuple[str, ...]] = ("group_id", "criterion_id")

    group_id: str = Field(description="Group the criterion applies to.")
    criterion_id: str = Field(description="Stable id (hash of group and text).")
    title: str = Field(description="At most about 8 words.")
    requirement: str = Field(description="One sentence: what passing means.")
    source: Literal["merge", "static", "generate", "union", "evolve"] = Field(
        description="Where the criterion came from (evolve: added by `replay propose`)."
    )


class VerdictRaw(Table):
    """One judge sample's verdict on one criterion for one rollout."""

    table_name: ClassVar[str] = "verdicts_raw"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "criterion_id", "judge", "sample")

    rollout_id: str = Field(description="Judged rollout.")
    criterion_id: str = Field(description="Criterion judged.")
    judge: str = Field(description="Judge arm label, e.g. frontier or self.")
    sample: int = Field(ge=0, description="Sample index 0..k-1.")
    verdict: Verdict | None = Field(description="pass, fail, na, or null = unanswered.")
    cited_steps: list[StepNumber] = Field(
        description="Steps that justify the verdict (1-based)."
    )
    reason: str | None = Field(None, description="The judge's short reason.")


class VerdictAggregated(Table):
    """Verdicts aggregated over samples (SPEC §3.2), with the discriminative flag (§3.3)."""

    table_name: ClassVar[str] = "verdicts"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "criterion_id", "judge")

    rollout_id: str = Field(description="Judged rollout.")
    criterion_id: str = Field(description="Criterion judged.")
    judge: str = Field(description="Judge arm label.")
    verdict: Verdict | None = Field(description="Aggregated verdict; null = unanswered.")
    cited_steps: list[StepNumber] = Field(
        description="Union of citations of the agreeing samples."
    )
    reason: str | None = Field(None, description="Reason (or why unanswered).")
    retained: bool | None = Field(
        None, description="Criterion failed by at least one member of the group (SPEC §3.3)."
    )


class Reward(Table):
    """Per-rollout reward and group advantage."""

    table_name: ClassVar[str] = "rewards"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id",)

    rollout_id: str = Field(description="The rollout.")
    group_id: str = Field(description="Its group.")
    n_pass: Int32 = Field(ge=0, description="Passed retained criteria.")
    n_fail: Int32 = Field(ge=0, description="Failed retained criteria.")
    n_na: Int32 = Field(ge=0, description="Retained criteria judged na.")
    reward: float | None = Field(None, description="Pass fraction over retained criteria.")
    pass_rate_all: float | None = Field(None, description="Pass fraction before the filter.")
    advantage: float = Field(description="Group advantage A_i.")
    credit_mode: CreditMode = Field(description="How the advantage was spread over tokens.")


class StepCredit(Table):
    """Per-step credit (SPEC §3.6)."""

    table_name: ClassVar[str] = "step_credit"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step")

    rollout_id: str = Field(description="The rollout.")
    step: Int32 = Field(ge=1, description="1-based step.")
    n_tokens: Int32 = Field(ge=1, le=MAX_TOKENS, description="Tokens of the step.")
    p: Int32 = Field(ge=0, description="Passed criteria citing the step.")
    f: Int32 = Field(ge=0, description="Failed criteria citing the step.")
    cited: bool = Field(description="Whether any pass/fail criterion cites the step.")
    quality: float | None = Field(None, description="Q_j.")
    weight: float | None = Field(None, description="w_j.")
    advantage: float = Field(description="a_j: advantage of every token of the step.")
    total: float = Field(description="n_j * a_j.")
    token_start: Int32 | None = Field(
        None, ge=0, le=MAX_TOKENS,
        description="The step's token_start, carried over for the token layout."
    )


class TokenAdvantages(Table):
    """Per-token advantages, dense or as spans (half-open token ranges); both round-trip."""

    table_name: ClassVar[str] = "token_advantages"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id",)

    rollout_id: str = Field(description="The rollout.")
    length: Int32 = Field(ge=0, le=MAX_TOKENS,
                          description="Tokens in the rollout's response sequence.")
    layout: Literal["positions", "end_to_end"] = Field(
        description="positions: tokens where the steps' token_start put them; end_to_end: no "
        "positions were known, steps laid end to end in step order (no gap or observation tokens)."
    )
    advantages: list[Float32] | None = Field(
        None, description="Dense form: one value per response token."
    )
    span_start: list[Int32] | None = Field(None, description="Spans form: range starts.")
    span_end: list[Int32] | None = Field(None, description="Spans form: range ends.")
    span_value: list[Float32] | None = Field(None, description="Spans form: range values.")
    train_step: Int32 | None = Field(
        None, description="Self-check: the train step of the rollout (a loader refuses rows of "
        "another step).")
    n_policy_tokens: Int32 | None = Field(
        None, ge=0, description="Self-check: tokens the trainer's response mask should mark 1.")
    response_fingerprint: str | None = Field(
        None, description="Self-check: hash of the trainer's response token ids, when positions "
        "came from them (draco_cli.trainers.loader.fingerprint).")


class StepLabel(Table):
    """A label on one step (SPEC §4, step-label audit): a person's or a judge's word on
    whether the step helped. One label per (rollout, step, labeler)."""

    table_name: ClassVar[str] = "step_labels"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "step", "labeler")

    rollout_id: str = Field(description="The rollout.")
    step: StepNumber = Field(description="1-based step in draco's numbering (steps.step).")
    label: Int32 = Field(ge=-1, le=1, description="-1 harmful or wrong, 0 neutral, "
                         "+1 correct and useful.")
    labeler: str = Field(description="Who gave the label: human, or a judge's name.")
    reason: str | None = Field(None, description="The labeler's explanation, if given.")
    message_index: Int32 | None = Field(None, ge=0, description="The labelled message's "
                                        "0-based index in the log's messages, when the source "
                                        "keyed labels by it (AgentProcessBench); maps a "
                                        "judge's labels, keyed the same way, to steps.")


class RubricDropout(Table):
    """Criteria ``--rubric-dropout`` left out of a step's reward and credit (after the
    discriminative filter), one row each; written only when P > 0."""

    table_name: ClassVar[str] = "rubric_dropout"
    keys: ClassVar[tuple[str, ...]] = ("group_id", "criterion_id")

    group_id: str = Field(description="Group whose retained criterion was left out.")
    criterion_id: str = Field(description="The criterion left out.")
    rubric_dropout: float = Field(gt=0, lt=1, description="P, the share asked for.")
    seed: int = Field(description="The dropout seed (--dropout-seed).")


class SpotCheck(Table):
    """``draco run --spot-check N``: N sampled verdicts of the training judge, each asked
    again of a second (gold) judge with the same score prompt on the same rubric. Never
    enters the reward."""

    table_name: ClassVar[str] = "spot_checks"
    keys: ClassVar[tuple[str, ...]] = ("rollout_id", "criterion_id")

    rollout_id: str = Field(description="Judged rollout.")
    group_id: str = Field(description="Its group.")
    criterion_id: str = Field(description="Criterion judged.")
    train_step: int | None = Field(None, ge=0, description="The run's train step.")
    judge: str = Field(description="The training judge's arm label.")
    judge_verdict: Verdict = Field(description="The training judge's aggregated verdict.")
    gold_verdict: Verdict | None = Field(None, description="The gold judge's verdict; null = "
                                         "unanswered.")
    judge_pass: bool | None = Field(None, description="judge_verdict is pass (null for na).")
    gold_pass: bool | None = Field(None, description="gold_verdict is pass (null for na or "
                                   "unanswered).")
    agree: bool | None = Field(None, description="The two verdicts are equal (null when the "
                               "gold judge left it unanswered).")
    retained: bool | None = Field(None, description="The criterion entered the reward "
                                  "(discriminative filter).")
    gold_model: str = Field(description="The gold judge's provider/model.")
    gold_reason: str | None = Field(None, description="The gold judge's reason (or why "
                                    "unanswered).")
    seed: int = Field(description="The sampling seed (--spot-check-seed).")


TABLES: dict[str, type[Table]] = {
    m.table_name: m
    for m in (
        Rollout,
        Step,
        RubricCandidate,
        Rubric,
        VerdictRaw,
        VerdictAggregated,
        Reward,
        StepCredit,
        TokenAdvantages,
        StepLabel,
        RubricDropout,
        SpotCheck,
    )
}
