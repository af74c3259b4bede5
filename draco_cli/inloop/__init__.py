"""Scoring inside the training loop: ``Scorer`` scores one group's tables; ``StepScorer`` takes
the trainer's finished rollouts (token ids and masks), scores each group as it completes and
hands back every rollout's per-token advantages, with a deadline, a fallback and the step's
metrics."""

from draco_cli.inloop.rows import TrainerRollout, trainer_rows
from draco_cli.inloop.scorer import CallTally, GroupScore, Scorer
from draco_cli.inloop.step import BlockingStepScorer, RowAdvantages, StepResult, StepScorer
from draco_cli.inloop.files import write_step
from draco_cli.inloop.health import JudgeHealthHistory, judge_health_history

__all__ = ["BlockingStepScorer", "CallTally", "GroupScore", "JudgeHealthHistory", "RowAdvantages",
           "Scorer", "StepResult", "StepScorer", "TrainerRollout", "judge_health_history", "trainer_rows",
           "write_step"]
