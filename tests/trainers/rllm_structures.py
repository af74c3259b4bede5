"""rLLM's structures for the rLLM adapter tests: its real code where a snapshot is on this
machine (``DRACO_RLLM_SRC`` = a folder holding the ``rllm`` package, e.g. an export of
rllm-org/rllm), else a contract of them.

The contract is written from rllm-org/rllm at commit 9beb6e0f676a46d38858991fd79ac5f8e0b16d4c
(rllm/types.py, rllm/trainer/algorithms/advantage.py and transform.py): the field names, types
and defaults draco relies on — ``Step.id`` (a uuid4 string by default), ``prompt_ids``,
``response_ids``, ``logprobs``, ``chat_completions``, ``model_response``, ``reward``,
``advantage: list[float] | float | None = None``; ``Trajectory.uid``, ``name``
(``default_traj_name``), ``task``, ``steps``, ``reward``, ``metadata``; ``Episode.id``
(``task_id:rollout_idx``), ``task``, ``termination_reason``, ``trajectories``;
``TrajectoryGroup.trajectories``, ``group_id`` (``task_id:trajectory_name``) — and the rule of
rLLM's precomputed-advantage path: per group, a float is spread over the step's response
tokens, a list of the wrong length becomes zeros (a warning only), a None in a group that
has values is an error.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

RLLM_SRC = os.environ.get("DRACO_RLLM_SRC")


class Step(BaseModel):
    id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    prompt_ids: list[Any] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    chat_completions: list[dict[str, Any]] = Field(default_factory=list)
    model_response: str = ""
    reward: float = 0.0
    done: bool = False
    advantage: list[float] | float | None = None


class Trajectory(BaseModel):
    uid: str = Field(default_factory=lambda: str(uuid.uuid4()))
    name: str = "default_traj_name"
    task: Any = None
    steps: list[Step] = Field(default_factory=list)
    reward: float | None = None
    metadata: dict[str, Any] | None = None


class Episode(BaseModel):
    id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    task: Any = None
    termination_reason: Any = None
    is_correct: bool = False
    trajectories: list[Trajectory] = Field(default_factory=list)
    metrics: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


class TrajectoryGroup(BaseModel):
    trajectories: list[Trajectory]
    group_id: str = ""
    metadata: list[dict[str, Any]] = Field(default_factory=list)


def contract_grouping(episodes: list[Any], transform_config: Any = None,
                      compact_filtering_config: Any = None) -> list[TrajectoryGroup]:
    by: dict[str, list[Any]] = defaultdict(list)
    for ep in episodes:
        for traj in ep.trajectories:
            if traj.steps:
                by[f"{ep.id.split(':')[0]}:{traj.name}"].append(traj)
    return [TrajectoryGroup(trajectories=t, group_id=g) for g, t in by.items()]


def contract_precomputed(group: Any) -> list[float]:
    """The flattened advantages rLLM trains on for one group, by the rule above."""
    flat: list[float] = []
    for traj in group.trajectories:
        for step in traj.steps:
            n = len(step.response_ids)
            if isinstance(step.advantage, float):
                flat += [step.advantage] * n
            elif isinstance(step.advantage, list):
                flat += step.advantage if len(step.advantage) == n else [0.0] * n
            else:
                raise ValueError("step.advantage must be a scalar or a list")
    return flat


def structures(kind: str) -> SimpleNamespace:
    """rLLM's classes and functions: ``real`` (the snapshot) or ``contract``."""
    if kind == "contract":
        return SimpleNamespace(kind=kind, Step=Step, Trajectory=Trajectory, Episode=Episode,
                               grouping=contract_grouping, precomputed=contract_precomputed,
                               model_output=None, termination="env_done",
                               config=None, transform=lambda eps, hook: hook(eps, None, None))
    assert RLLM_SRC, "DRACO_RLLM_SRC is not set"
    if RLLM_SRC not in sys.path:
        sys.path.insert(0, RLLM_SRC)
    from rllm.engine.rollout import ModelOutput
    from rllm.trainer.algorithms.advantage import _collect_precomputed_advantages
    from rllm.trainer.algorithms.config import TransformConfig
    from rllm.trainer.algorithms.transform import (_default_traj_grouping_hook,
                                                   transform_episodes_to_trajectory_groups)
    from rllm.types import Episode as E
    from rllm.types import Step as S
    from rllm.types import Trajectory as T
    from rllm.workflows.workflow import TerminationReason

    return SimpleNamespace(kind=kind, Step=S, Trajectory=T, Episode=E,
                           grouping=_default_traj_grouping_hook,
                           precomputed=lambda g: _collect_precomputed_advantages(g, "test"),
                           model_output=ModelOutput, termination=TerminationReason.ENV_DONE,
                           config=TransformConfig(),
                           # rLLM's own entry point, calling the hook as its trainer does
                           transform=lambda eps, hook: transform_episodes_to_trajectory_groups(
                               eps, TransformConfig(), None, traj_grouping_hook=hook)[0])


def make_episodes(rl: SimpleNamespace, rng: np.random.Generator, tasks: int, n: int,
                  *, name: str = "solver", reset_at: int | None = None) -> list[Any]:
    """``tasks`` × ``n`` episodes of one trajectory each, 1–3 steps of random lengths, each
    step's prompt the previous prompt + response + an observation (rLLM's cumulative chat),
    or, at step ``reset_at``, a fresh prompt (a context reset)."""
    out = []
    for t in range(tasks):
        for k in range(n):
            prompt = [1, 2] + rng.integers(10, 900, int(rng.integers(3, 8))).tolist()
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"solve task {t}"}]
            steps = []
            for s in range(int(rng.integers(1, 4))):
                if reset_at is not None and s == reset_at:
                    prompt = [1, 2] + rng.integers(10, 900, 4).tolist()
                resp = rng.integers(10, 900, int(rng.integers(2, 9))).tolist()
                text = f"action {s} of {t}/{k}"
                if rl.model_output is not None:   # the way rLLM's agents make their steps
                    mo = rl.model_output(content=text, prompt_ids=list(prompt),
                                         completion_ids=resp, logprobs=[-0.5] * len(resp))
                    step = rl.Step.from_model_output(mo, messages=list(msgs))
                else:
                    step = rl.Step(prompt_ids=list(prompt), response_ids=resp,
                                   logprobs=[-0.5] * len(resp), model_response=text,
                                   chat_completions=[*msgs, {"role": "assistant",
                                                             "content": text}])
                steps.append(step)
                obs = rng.integers(10, 900, int(rng.integers(1, 5))).tolist()
                msgs = [*msgs, {"role": "assistant", "content": text},
                        {"role": "tool", "content": f"result {s}"}]
                prompt = prompt + resp + obs
            traj = rl.Trajectory(name=name, steps=steps, reward=float(rng.integers(0, 2)),
                                 task={"question": f"solve task {t}"})
            out.append(rl.Episode(id=f"task{t}:{k}", task={"question": f"solve task {t}"},
                                  termination_reason=rl.termination, trajectories=[traj]))
    return out
