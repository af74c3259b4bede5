"""prime-rl: a draco ``Algorithm`` whose ``score_group`` fills each trace's per-token advantages.

See docs/trainers.md, "verifiers and prime-rl" (read at commit 559b447, docs/decisions.md).
prime-rl's algorithm list is closed, so ``register`` puts draco's class under an existing type
(``grpo`` by default) instead of a new one. ``DracoCredit`` is the prime-rl-free half (it also
serves the tests without prime-rl).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from draco_cli.errors import InputError, UsageError
from draco_cli.inloop.files import write_step
from draco_cli.inloop.step import StepResult, StepScorer
from draco_cli.trainers import field_of
from draco_cli.trainers.verifiers import assign_compact, fill_trace, trace_rollout

__all__ = ["DracoCredit", "algorithm_class", "register", "trainable_traces"]

ShortGroups = Literal["score", "skip", "error"]
Assign = Callable[[Any, list[float]], None]
RECENT_RESULTS = 256   # DracoCredit.results keeps this many


def trainable_traces(episodes: Iterable[Any]) -> list[Any]:
    """The traces prime-rl trains on, in its order (``iter_trainable_traces`` at the commit
    above): no error, a trainable agent, at least one sampled token."""
    return [t for ep in episodes for t in field_of(ep, "traces", [])
            if field_of(t, "ok", False) and field_of(field_of(t, "agent"), "trainable", True)
            and any(any(field_of(n, "mask") or []) for n in field_of(t, "nodes", []))]


def group_identity(episodes: Sequence[Any], traces: Sequence[Any]) -> tuple[str, int | None]:
    """(group id, train step) of a prime-rl group: the ``group.id`` the dispatcher stamps (a
    hash of the trace ids where there is none) and ``run.work.step``."""
    ids = {str(field_of(g, "id")) for ep in episodes if (g := field_of(ep, "group")) is not None}
    if len(ids) > 1:
        raise InputError(f"one group's episodes carry group ids {sorted(ids)}",
                         field="group.id")
    gid = ids.pop() if ids else "traces-" + hashlib.sha256(
        "\n".join(sorted(str(field_of(t, "id")) for t in traces)).encode()).hexdigest()[:16]
    steps = {field_of(w, "step") for ep in episodes
             if (w := field_of(field_of(ep, "run"), "work")) is not None}
    steps.discard(None)
    if len(steps) > 1:
        raise InputError(f"group {gid!r}: episodes from train steps {sorted(steps)}",
                         field="run.work.step")
    return gid, (int(steps.pop()) if steps else None)


@dataclass
class DracoCredit:
    """Scores prime-rl groups with a ``StepScorer`` (opened by the caller) and assigns each
    trace's compact advantages with ``assign`` (prime-rl's ``assign_advantages`` when run inside
    prime-rl; draco's ``assign_compact`` rule otherwise). ``steps_dir``: each group's tables
    written there (``write_step``'s layout, one folder a step and group)."""

    scorer: StepScorer
    short_groups: ShortGroups = "score"
    steps_dir: Path | None = None
    short: int = 0
    # the latest groups' results (bounded: a run scores thousands of groups, each result
    # holding its decoded rollouts)
    results: deque[StepResult] = field(default_factory=lambda: deque(maxlen=RECENT_RESULTS))

    async def score_group(self, episodes: Sequence[Any], traces: Sequence[Any] | None = None,
                          assign: Assign | None = None) -> StepResult | None:
        """Judge the group and fill its traces; None when no trace was filled (no trainable
        trace, or a short group under ``short_groups="skip"``)."""
        traces = trainable_traces(episodes) if traces is None else list(traces)
        if not traces:
            return None
        gid, step = group_identity(episodes, traces)
        if len(traces) > self.scorer.group_size:
            raise InputError(f"group {gid!r}: {len(traces)} trainable traces, more than "
                             f"group_size {self.scorer.group_size}", field="group_size")
        if len(traces) < self.scorer.group_size:
            self.short += 1
            if self.short_groups == "error":
                raise InputError(f"group {gid!r}: {len(traces)} trainable traces, group_size "
                                 f"is {self.scorer.group_size}", field="group_size")
            if self.short_groups == "skip":
                return None
        rollouts = [trace_rollout(t, gid, train_step=step, row=k) for k, t in enumerate(traces)]
        for r in rollouts:
            await self.scorer.add(r, group_size=len(rollouts))
        result = await self.scorer.finish(step, groups=[gid])
        # every trace checked before any is written: a misfit leaves the whole group unassigned
        staged = [fill_trace(_staged(t), result.rows[r.rollout_id].rollout_id,
                             result.rows[r.rollout_id].values)
                  for t, r in zip(traces, rollouts)]
        for trace, compact in zip(traces, staged):
            (assign or assign_compact)(trace, compact)
        self.results.append(result)
        if self.steps_dir is not None:
            write_step(result, self.steps_dir / gid)
        return result


def _staged(trace: Any) -> dict[str, Any]:
    """A copy of a trace's ids and masks for ``fill_trace`` to check and fill, the real trace
    untouched."""
    return {"id": field_of(trace, "id"),
            "nodes": [{"token_ids": field_of(n, "token_ids"), "mask": field_of(n, "mask")}
                      for n in field_of(trace, "nodes", [])]}


def algorithm_class(model: str, *, short_groups: ShortGroups = "score",
                    steps_dir: str | Path | None = None, **scorer: Any) -> type[Any]:
    """A subclass of prime-rl's ``Algorithm`` scoring every group with draco; ``scorer`` are
    ``StepScorer``'s arguments (``call_log``, ``group_size``, ``decode``, ``deadline``, …).
    Its scorer opens in ``setup`` (prime-rl awaits it before the first rollout)."""
    # prime-rl is not on the package index (nor typed): imported only here, when asked for
    from prime_rl.orchestrator.algo.base import (  # type: ignore[import-not-found]
        Algorithm, iter_trainable_traces)
    from prime_rl.orchestrator.algo.routing import (  # type: ignore[import-not-found]
        assign_advantages)

    out = None if steps_dir is None else Path(steps_dir)

    class DracoAlgorithm(Algorithm):  # type: ignore[misc]
        """Step-level credit from draco's judge (see draco_cli.trainers.prime_rl)."""

        action_loss_type = "rl"

        def __init__(self, config: Any, policy_pool: Any) -> None:
            super().__init__(config, policy_pool)
            self.draco: DracoCredit | None = None

        async def setup(self) -> None:
            await super().setup()
            step_scorer = await StepScorer(model, **scorer).__aenter__()
            self.draco = DracoCredit(step_scorer, short_groups, out)

        async def score_group(self, episodes: list[Any]) -> None:
            if self.draco is None:
                raise UsageError("DracoAlgorithm.score_group before setup(): prime-rl's "
                                 "orchestrator awaits setup first")
            traces = [t for _, t in iter_trainable_traces(episodes)]
            await self.draco.score_group(episodes, traces, assign_advantages)

    return DracoAlgorithm


def register(cls: type[Any], name: str = "grpo") -> None:
    """Make prime-rl's ``build_algorithm`` build ``cls`` for ``[orchestrator.algo] type =
    name`` (an existing config type whose loss is ``rl``, see the module doc)."""
    import prime_rl.orchestrator.algo as algo  # type: ignore[import-not-found]

    if name not in algo.ALGORITHM_CLASSES:
        raise UsageError(f"prime-rl has no algorithm type {name!r} to stand in for (its list "
                         f"is closed: {', '.join(algo.ALGORITHM_CLASSES)})")
    if algo.ALGORITHM_CLASSES[name].action_loss_type != cls.action_loss_type:
        raise UsageError(f"algorithm type {name!r} trains with the "
                         f"{algo.ALGORITHM_CLASSES[name].action_loss_type} loss, draco's with rl")
    algo.ALGORITHM_CLASSES[name] = cls
