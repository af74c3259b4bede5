"""The values each choice option takes, declared once: the option objects validate them
(``draco_cli.options``) and the command line offers them, without importing pydantic."""

from __future__ import annotations

from typing import Literal, get_args

CreditKind = Literal["step", "uniform"]
Estimator = Literal["grpo", "rloo"]
StdMode = Literal["sample", "population", "none"]
Drop = Literal["all-pass", "constant"]
TokenForm = Literal["dense", "spans", "both"]
RewardSource = Literal["rubric", "outcome"]
Aggregate = Literal["all", "majority"]
RubricKind = Literal["dynamic", "static", "none"]
Setting = Literal["draco", "no-credit", "static", "static-no-credit", "outcome"]
Stage = Literal["rubric", "judge", "credit"]
STAGES: tuple[str, ...] = ("rubric", "judge", "credit")
StepUnit = Literal["message", "code-block", "tool-call"]   # draco ingest --step-unit
STEP_UNITS: tuple[str, ...] = get_args(StepUnit)
CodeBlocks = Literal["one", "all"]                          # draco ingest --code-blocks
CODE_BLOCKS: tuple[str, ...] = get_args(CodeBlocks)
IngestFormat = Literal["openai-jsonl", "tau-bench", "tau2-bench", "agentprocessbench",
                       "verifiers", "rllm", "skyrl", "slime"]   # draco ingest FORMAT
