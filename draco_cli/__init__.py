"""draco: dynamic rubrics and step-level credit for RL on LLM agents.

The Python API, for training loops and scripts (the CLI is a thin layer over the same calls)::

    import draco_cli as draco

    # in the loop: score each group as its rollouts finish
    async with draco.Scorer("openai/judge", call_log="runs/llm_calls.sqlite") as scorer:
        scored = await scorer.score_group(rollouts, steps)      # polars or Arrow tables
        scored.token_advantages                                  # one row per rollout

    # one whole training step from files, as ``draco run``
    result = draco.run_step(rollouts, steps, out, draco.LLMSettings(model="openai/judge"))

    # trainer side: per-token advantages aligned to the trainer's rows
    table = draco.load_token_advantages("runs/step-7/credit/token_advantages.parquet")

Names are imported on first use, so ``import draco_cli`` stays cheap. The library never
prints and never exits; its errors are ``DracoError`` subclasses naming file, row and field.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from draco_cli.errors import DracoError, InputError, UsageError
    from draco_cli.evaluate.core import evaluate
    from draco_cli.ingest import ingest_logs
    from draco_cli.io import read_table, write_table
    from draco_cli.judge.stage import judge_filter, judge_score
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.options import CreditOptions, JudgeOptions, RubricOptions, RunOptions
    from draco_cli.rubric.stage import rubric_generate, rubric_static
    from draco_cli.inloop.rows import TrainerRollout
    from draco_cli.inloop.scorer import GroupScore, Scorer
    from draco_cli.inloop.step import StepResult, StepScorer
    from draco_cli.run.pipeline import RunResult, run_step
    from draco_cli.trainers.loader import (AlignmentError, TokenAdvantageTable,
                                           load_token_advantages)

_WHERE = {
    "DracoError": "draco_cli.errors", "InputError": "draco_cli.errors",
    "UsageError": "draco_cli.errors",
    "evaluate": "draco_cli.evaluate.core",
    "ingest_logs": "draco_cli.ingest",
    "read_table": "draco_cli.io", "write_table": "draco_cli.io",
    "judge_filter": "draco_cli.judge.stage", "judge_score": "draco_cli.judge.stage",
    "LLMSettings": "draco_cli.llm.settings",
    "CreditOptions": "draco_cli.options", "JudgeOptions": "draco_cli.options",
    "RubricOptions": "draco_cli.options", "RunOptions": "draco_cli.options",
    "rubric_generate": "draco_cli.rubric.stage", "rubric_static": "draco_cli.rubric.stage",
    "GroupScore": "draco_cli.inloop.scorer", "Scorer": "draco_cli.inloop.scorer",
    "StepScorer": "draco_cli.inloop.step", "StepResult": "draco_cli.inloop.step",
    "TrainerRollout": "draco_cli.inloop.rows",
    "RunResult": "draco_cli.run.pipeline", "run_step": "draco_cli.run.pipeline",
    "AlignmentError": "draco_cli.trainers.loader",
    "TokenAdvantageTable": "draco_cli.trainers.loader",
    "load_token_advantages": "draco_cli.trainers.loader",
}
__all__ = ["AlignmentError", "CreditOptions", "DracoError", "GroupScore", "InputError",
           "JudgeOptions", "LLMSettings", "RubricOptions", "RunOptions", "RunResult", "Scorer",
           "StepResult", "StepScorer", "TrainerRollout",
           "TokenAdvantageTable", "UsageError", "evaluate", "ingest_logs", "judge_filter",
           "judge_score", "load_token_advantages", "read_table", "rubric_generate",
           "rubric_static", "run_step", "write_table"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'draco_cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
