"""draco's advantages into rLLM's precomputed-advantage path, inside the training loop.

See docs/trainers.md, "rLLM" (read at 9beb6e0f). rLLM's ``_collect_precomputed_advantages``
replaces a list of the wrong length by zeros with only a warning, so every length is checked
here, and refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from draco_cli.errors import InputError, UsageError
from draco_cli.inloop.rows import Decode, TrainerRollout
from draco_cli.inloop.step import BlockingStepScorer, StepResult, StepScorer
from draco_cli.trainers.rllm.layout import (TrajectoryLayout, check_same, field_of,
                                            group_id_of, instruction_of, layout_of,
                                            step_values)


@dataclass(frozen=True)
class ScoredTrajectory:
    trajectory: Any
    layout: TrajectoryLayout
    rollout: TrainerRollout


def _instruction(traj: Any, decode: Decode) -> str:
    steps = field_of(traj, "steps") or []
    first = steps[0] if steps else None
    text = instruction_of(field_of(traj, "task"), field_of(first, "chat_completions") or [])
    if text:
        return text
    prompt = field_of(first, "prompt_ids") or []
    return decode([int(t) for t in prompt]) if prompt else ""


def plan_groups(groups: Sequence[Any], *, group_size: int, decode: Decode,
                train_step: int | None = None) -> list[ScoredTrajectory]:
    """rLLM ``TrajectoryGroup``s → draco rollouts (checked: uids unique, each group of
    ``group_size``), in group order."""
    planned: list[ScoredTrajectory] = []
    seen: set[str] = set()
    for group in groups:
        gid = field_of(group, "group_id")
        trajs = list(field_of(group, "trajectories") or [])
        if not isinstance(gid, str) or not gid:
            raise InputError(f"TrajectoryGroup {gid!r}: needs its string group_id "
                             "('task_id:trajectory_name')", field="group_id")
        if len(trajs) != group_size:
            raise InputError(f"TrajectoryGroup {gid!r}: {len(trajs)} trajectories, the "
                             f"scorer's group_size is {group_size} (rLLM's compact filtering "
                             "or a failed rollout changes a group's size)",
                             field="trajectories")
        for traj in trajs:
            layout = layout_of(traj)
            if layout.rollout_id in seen:
                raise InputError(f"trajectory {layout.rollout_id!r}: uid appears twice in "
                                 "the step's groups", field="uid")
            seen.add(layout.rollout_id)
            reward = field_of(traj, "reward")
            rollout = layout.rollout(group_id=gid, instruction=_instruction(traj, decode),
                                     outcome=None if reward is None else float(reward),
                                     task_id=gid.split(":")[0], train_step=train_step,
                                     row=len(planned))
            planned.append(ScoredTrajectory(traj, layout, rollout))
    return planned


def apply_advantages(planned: Sequence[ScoredTrajectory], result: StepResult) -> int:
    """Set every planned step's ``advantage`` from ``result``: all checked first, then all
    set (whole or not at all). Returns the number of steps set."""
    cuts: list[tuple[Any, list[list[float]]]] = []
    for p in planned:
        row = result.rows.get(p.layout.rollout_id)
        if row is None:
            raise InputError(f"trajectory {p.layout.rollout_id!r}: no advantages in the "
                             "scored step", field="uid")
        check_same(p.trajectory, p.layout)
        cuts.append((p.trajectory, step_values(p.layout, row.values)))
    return _set_steps(cuts)


async def assign_advantages(scorer: StepScorer, groups: Sequence[Any], *,
                            train_step: int | None = None) -> StepResult:
    """Score rLLM ``TrajectoryGroup``s (each group judged as soon as it is added whole) and
    set every step's per-token ``advantage``; the step's ``StepResult`` (metrics for the
    trainer's logger)."""
    planned = plan_groups(groups, group_size=scorer.group_size, decode=scorer.decode,
                          train_step=train_step)
    result = await scorer.score_step([p.rollout for p in planned], train_step)
    apply_advantages(planned, result)
    return result


def assign_advantages_blocking(scorer: BlockingStepScorer, groups: Sequence[Any], *,
                               train_step: int | None = None) -> StepResult:
    """``assign_advantages`` for synchronous code (rLLM's grouping hook is synchronous)."""
    inner = scorer.inner
    planned = plan_groups(groups, group_size=inner.group_size, decode=inner.decode,
                          train_step=train_step)
    result = scorer.score_step([p.rollout for p in planned], train_step)
    apply_advantages(planned, result)
    return result


GroupingHook = Callable[..., list[Any]]


def check_algorithm_config(config: Any) -> None:
    """rLLM's ``AlgorithmConfig`` (or its ``rllm.algorithm`` config section) must set
    ``use_precomputed_advantage``: without it rLLM overwrites every step's advantage with its
    own estimator, with a warning only, and draco's values would be dropped unseen."""
    if field_of(config, "use_precomputed_advantage", None) is not True:
        raise UsageError("rLLM's rllm.algorithm.use_precomputed_advantage must be true: "
                         "otherwise rLLM replaces draco's step advantages with its own "
                         "estimator's")


class DracoGroupingHook:
    """An rLLM ``traj_grouping_hook``: groups as ``base`` (rLLM's own
    ``_default_traj_grouping_hook`` or yours) forms them, then draco's advantages set on every
    step. ``train_step`` counts the calls from ``first_step``; ``last`` is the latest
    ``StepResult`` (``last.metrics`` for the logger). rLLM calls the same hook for its
    validation episodes: ``score=lambda episodes: ...`` returning False leaves a call's groups
    unscored (their advantages stay None) and does not count it as a step. Given rLLM's
    ``algorithm_config``, it is checked by ``check_algorithm_config``."""

    def __init__(self, scorer: BlockingStepScorer, base: GroupingHook, *, first_step: int = 0,
                 score: Callable[[list[Any]], bool] | None = None,
                 algorithm_config: Any = None) -> None:
        if algorithm_config is not None:
            check_algorithm_config(algorithm_config)
        if not callable(base):
            raise UsageError("base: rLLM's grouping hook (a callable), e.g. "
                             "rllm.trainer.algorithms.transform._default_traj_grouping_hook")
        self.scorer, self.base, self.score = scorer, base, score
        self.train_step = first_step
        self.last: StepResult | None = None

    def __call__(self, episodes: list[Any], transform_config: Any,
                 compact_filtering_config: Any = None) -> list[Any]:
        groups = self.base(episodes, transform_config, compact_filtering_config)
        if self.score is not None and not self.score(episodes):
            return groups
        self.last = assign_advantages_blocking(self.scorer, groups, train_step=self.train_step)
        self.train_step += 1
        return groups


class EpisodeCredit:
    """For code that sees rLLM's episodes one at a time as they finish (a workflow, a buffer
    of your own): ``await add(episode)`` as each finishes — a group is judged the moment its
    last member arrives, while others still generate — then ``await assign(episode)`` waits
    for its groups and sets its steps' advantages; ``finish()`` ends the step (its metrics).
    Groups are rLLM's (``task_id:trajectory_name``); trajectories without steps are skipped,
    as rLLM's grouping skips them, and a missing trajectory reward is the last step's, as
    rLLM propagates it."""

    def __init__(self, scorer: StepScorer, *, train_step: int | None = None) -> None:
        self.scorer, self.train_step = scorer, train_step
        self._layouts: dict[str, TrajectoryLayout] = {}

    @staticmethod
    def _trajectories(episode: Any) -> list[Any]:
        return [t for t in field_of(episode, "trajectories") or [] if field_of(t, "steps")]

    async def add(self, episode: Any) -> None:
        eid = field_of(episode, "id")
        if not isinstance(eid, str) or not eid:
            raise InputError(f"episode {eid!r}: needs rLLM's string id ('task_id:index')",
                             field="id")
        for traj in self._trajectories(episode):
            layout = layout_of(traj)
            if layout.rollout_id in self._layouts:
                raise InputError(f"trajectory {layout.rollout_id!r}: added twice",
                                 field="uid")
            reward = field_of(traj, "reward")
            if reward is None:
                reward = field_of(field_of(traj, "steps")[-1], "reward")
            gid = group_id_of(eid, str(field_of(traj, "name") or "default_traj_name"))
            await self.scorer.add(layout.rollout(
                group_id=gid, instruction=_instruction(traj, self.scorer.decode),
                outcome=None if reward is None else float(reward), task_id=gid.split(":")[0],
                train_step=self.train_step, row=len(self._layouts)))
            self._layouts[layout.rollout_id] = layout

    async def assign(self, episode: Any) -> int:
        """Set the advantages of every step of ``episode`` (all checked, then all set);
        the number of steps set."""
        cuts: list[tuple[Any, list[list[float]]]] = []
        for traj in self._trajectories(episode):
            uid = field_of(traj, "uid")
            layout = self._layouts.get(uid)
            if layout is None:
                raise InputError(f"trajectory {uid!r}: not added to this step", field="uid")
            row = await self.scorer.advantages(uid, self.train_step)
            check_same(traj, layout)
            cuts.append((traj, step_values(layout, row.values)))
        return _set_steps(cuts)

    async def finish(self) -> StepResult:
        result = await self.scorer.finish(self.train_step)
        self._layouts.clear()
        return result


def _set_steps(cuts: list[tuple[Any, list[Any]]]) -> int:
    """Every step's advantage set, only once every trajectory was checked (all or none)."""
    n = 0
    for traj, lists in cuts:
        for step, values in zip(field_of(traj, "steps"), lists):
            step.advantage = values
            n += 1
    return n
