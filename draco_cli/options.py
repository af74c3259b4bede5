"""Option objects of the library: one per concern (rubric, judge, credit, run), built by the
command line and taken by the Python API; checked before any work (docs/run.md, "Options are
checked before any work").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from draco_cli.errors import UsageError

from draco_cli.choices import (Aggregate, CreditKind, Drop, Estimator, RewardSource,
                               RubricKind, Setting, Stage, StdMode, TokenForm)

# setting -> (rubric, credit, reward): the DRACO paper's four ablations (SPEC §3.7) and its
# principal control, vanilla GRPO on the environment outcome (no rubric, no judge, no LLM).
SETTINGS: dict[str, tuple[str, str, str]] = {
    "draco": ("dynamic", "step", "rubric"),
    "no-credit": ("dynamic", "uniform", "rubric"),
    "static": ("static", "step", "rubric"),
    "static-no-credit": ("static", "uniform", "rubric"),
    "outcome": ("none", "uniform", "outcome"),
}


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def build(cls: type[_T], **values: Any) -> _T:
        """Validate ``values`` into this object; a bad value raises UsageError (exit 2)
        naming the option, never a pydantic traceback."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise UsageError(_one_line(exc)) from None


_T = TypeVar("_T", bound=_Options)


def _one_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    if err["type"] == "value_error":  # our own checks: the message names its options
        return str(err["msg"]).removeprefix("Value error, ")
    loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
    name = loc[-1] if loc else ""
    flag = "--" + name.replace("_", "-") if name else "options"
    value = err.get("input")
    msg = err["msg"]
    if err["type"] == "literal_error":
        msg = "choose " + msg.removeprefix("Input should be ").replace("'", "")
    shown = f" {value!r}" if isinstance(value, (str, int, float)) else ""
    return f"{flag}{shown}: {msg}"


class RubricOptions(_Options):
    """How the rubric stage writes criteria (``draco rubric generate`` / a static rubric)."""

    kind: RubricKind = "dynamic"
    max_criteria: Annotated[int, Field(ge=1)] = 8
    static_rubric: Path | None = None  # None: draco's own default rubric
    # the LLM phases, in order; merge combines what generate and union wrote in the same run
    stages: tuple[Literal["generate", "union", "merge"], ...] = ("generate", "union", "merge")
    # merge alone on another run's candidate pool (rubric_candidates.parquet): the paper's
    # merge-on-a-fixed-pool replay (Figure 9c)
    candidates: Path | None = None

    @field_validator("stages", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:   # "generate,union" as the command line spells it
        if isinstance(value, str):
            return tuple(x.strip() for x in value.split(",") if x.strip())
        return value

    @model_validator(mode="after")
    def _merge_has_candidates(self) -> RubricOptions:
        if self.candidates is not None:
            if self.stages != ("merge",):
                raise ValueError("--candidates: the merge stage alone runs on another run's "
                                 "candidates; pass --stages merge")
            return self
        if "merge" in self.stages and not {"generate", "union"} & set(self.stages):
            raise ValueError("--stages merge: merge combines the candidates that generate and "
                             "union write in the same run; add them (e.g. --stages union,merge), "
                             "or give another run's with --candidates")
        return self


class PromptOptions(_Options):
    """What every LLM stage sends: answer and prompt budgets, and what is masked first."""

    max_tokens: Annotated[int, Field(ge=16)] = 4096
    max_prompt_tokens: Annotated[int, Field(ge=500)] = 24000
    redact: tuple[str, ...] = ()
    no_default_redact: bool = False

    @model_validator(mode="after")
    def _regexes_compile(self) -> PromptOptions:
        for pattern in self.redact:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"--redact: not a regular expression ({pattern!r}: {exc})") from None
        return self


class JudgeOptions(_Options):
    """How the judge stage scores rollouts (``draco judge score``)."""

    judge_model: str | None = None  # None: the run's --model
    samples: Annotated[int, Field(ge=1)] = 1
    aggregate: Aggregate = "all"
    judge_label: Annotated[str, Field(min_length=1)] = "judge"


class CreditOptions(_Options):
    """Filter, rewards, advantages and credit (``draco credit compute``)."""

    credit: CreditKind = "step"
    estimator: Estimator = "grpo"
    std: StdMode = "sample"
    drop: Drop = "all-pass"
    tokens: TokenForm = "spans"
    reward: RewardSource = "rubric"
    judge: str | None = None
    # a seeded share of each group's retained criteria left out of the reward (credit.dropout)
    rubric_dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    dropout_seed: int = 0
    # the train step token advantages name where the rollouts do not say theirs (a trainer's
    # loader refuses a step claimed against a file that records none)
    train_step: Annotated[int | None, Field(ge=0)] = None

    def credit_args(self) -> dict[str, Any]:
        """The options ``compute_credit`` takes (the token form and step are applied after)."""
        return self.model_dump(exclude={"tokens", "train_step"})


class RunOptions(_Options):
    """One ``draco run``: a setting, the options of its three stages, and its health rule."""

    setting: Setting = "draco"
    rubric: RubricOptions = RubricOptions()
    prompt: PromptOptions = PromptOptions()
    judge: JudgeOptions = JudgeOptions()
    credit: CreditOptions = CreditOptions()
    train_step: Annotated[int | None, Field(ge=0)] = None
    # the health check: a stage whose share of answered calls falls below this fails the run
    min_answered: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9
    # the signal check: a step where no more than this share of rollouts has a non-zero
    # advantage, or whose filter dropped every criterion, gives the trainer nothing to learn
    min_signal: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    allow_no_signal: bool = False
    restart: bool = False   # a run folder of other inputs: clear its tables instead of refusing
    redo: tuple[Stage, ...] = ()
    call_log: Path | None = None  # None: RUN/llm_calls.sqlite
    # where the LLM stages run: this process, or a Ray cluster's workers (engine_ray.py)
    engine: Literal["local", "ray"] = "local"
    ray_address: str | None = None   # None: a local cluster (or RAY_ADDRESS)
    partitions: Annotated[int, Field(ge=1)] | None = None   # None: the cluster's CPUs
    # --spot-check N: N sampled verdicts per step asked again of a gold judge (judge/spot.py);
    # they never change the reward
    spot_check: Annotated[int, Field(ge=0)] = 0
    spot_check_seed: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _fits_setting(self) -> RunOptions:
        rubric = SETTINGS[self.setting][0]
        if self.setting == "outcome":
            if self.credit.credit != "uniform":
                raise ValueError("--setting outcome has no rubric to spread credit by: it "
                                 "takes --credit uniform only")
            if self.credit.reward != "outcome":
                raise ValueError("--setting outcome rewards the environment outcome: it takes "
                                 "--reward outcome only")
        if self.rubric.kind != rubric:
            raise ValueError(f"--setting {self.setting} implies a {rubric} rubric")
        if self.spot_check and self.rubric.kind == "none":
            raise ValueError(f"--spot-check: --setting {self.setting} has no judge to check")
        return self

    @classmethod
    def for_setting(cls, setting: str = "draco", *, credit: str | None = None,
                    reward: str | None = None,
                    rubric: RubricOptions | dict[str, Any] | None = None,
                    prompt: PromptOptions | dict[str, Any] | None = None,
                    judge: JudgeOptions | dict[str, Any] | None = None,
                    credit_options: dict[str, Any] | None = None,
                    **run: Any) -> RunOptions:
        """Options of one setting; ``credit`` / ``reward`` override what the setting implies
        (e.g. ``--setting draco --reward outcome``: dynamic rubrics, outcome reward, step
        credit spread by the judge's citations). Stage options are objects or their fields as
        dicts; the rubric's kind is the setting's."""
        if setting not in SETTINGS:
            raise UsageError(f"--setting {setting!r}: choose {', '.join(SETTINGS)}")
        kind, default_credit, default_reward = SETTINGS[setting]
        return cls.build(
            setting=cast(Setting, setting),
            rubric=(rubric if isinstance(rubric, RubricOptions) else
                    RubricOptions.build(**(rubric or {}))).model_copy(
                update={"kind": cast(RubricKind, kind)}),
            prompt=PromptOptions.build(**prompt) if isinstance(prompt, dict) else
            prompt or PromptOptions(),
            judge=JudgeOptions.build(**judge) if isinstance(judge, dict) else
            judge or JudgeOptions(),
            credit=CreditOptions.build(credit=cast(CreditKind, credit or default_credit),
                                       reward=cast(RewardSource, reward or default_reward),
                                       **(credit_options or {})),
            **run)

    @property
    def uses_llm(self) -> bool:
        return self.rubric.kind != "none"
