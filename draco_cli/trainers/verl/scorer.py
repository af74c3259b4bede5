"""The one shared scorer of a verl training job: a named async Ray actor hosting a StepScorer, so a
group whose sessions ran on different workers is judged in one place. The estimator calls
``finish_groups`` for the batch's groups. Settings (``DRACO_INLOOP``): docs/trainers.md,
"verl (0.9)"."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from draco_cli.errors import UsageError

ENV_SETTINGS = "DRACO_INLOOP"
# s a finished session waits for the rest of its group: none by default (verl V1's colocated
# async mode holds finished sessions through a whole training step); a session that fails or
# is cancelled releases its group at once (``member_failed``)
DEFAULT_WAIT: float | None = None
ACTOR_NAME = "draco_step_scorer"
# the keys the actor reads itself; every other key is a StepScorer keyword
_OWN = ("model", "audit_dir", "keep", "wait_timeout")


def settings(raw: str | None = None) -> dict[str, Any]:
    """The in-loop settings from ``DRACO_INLOOP`` (a JSON object with at least ``model`` and
    ``call_log``); a bad value is a one-line UsageError naming the variable."""
    raw = os.environ.get(ENV_SETTINGS) if raw is None else raw
    if not raw:
        raise UsageError(f"{ENV_SETTINGS} is not set: give the judge model and call log as JSON, "
                         'e.g. {"model": "openai/gpt-4.1-mini", "call_log": "llm_calls.sqlite"}')
    try:
        got = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UsageError(f"{ENV_SETTINGS}: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(got, dict):
        raise UsageError(f"{ENV_SETTINGS}: expected a JSON object, got {type(got).__name__}")
    for key in ("model", "call_log"):
        if not got.get(key):
            raise UsageError(f"{ENV_SETTINGS}: {key!r} is required")
    return got


@dataclass
class _Wait:
    """One group's sessions in the actor: its size, the rollouts arrived, the event set when
    all have (or a member failed), and why it will never be whole."""

    size: int = 0
    arrived: list[str] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None


class DracoScorerActor:
    """The StepScorer behind the named actor (``ray.remote`` applied in ``scorer_handle``);
    async methods, so every session's ``score`` waits concurrently on the actor's loop."""

    def __init__(self, config: dict[str, Any], group_size: int, tokenizer: Any) -> None:
        self.config, self.group_size, self.tokenizer = dict(config), group_size, tokenizer
        self._scorer: Any = None
        self._lock = asyncio.Lock()
        self._groups: dict[tuple[int | None, str], _Wait] = {}   # by (train step, group)
        self._written: set[int] = set()   # steps with an audit folder from this actor

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    async def _get(self) -> Any:
        from draco_cli.inloop import StepScorer

        async with self._lock:
            if self._scorer is None:
                c = self.config
                scorer = StepScorer(c["model"], group_size=self.group_size, decode=self._decode,
                                    **{k: v for k, v in c.items() if k not in _OWN})
                self._scorer = await scorer.__aenter__()
        return self._scorer

    async def score(self, rollout: dict[str, Any], group_size: int | None = None
                    ) -> dict[str, Any]:
        """Add one finished rollout (TrainerRollout fields); its advantages once its group is
        scored or has fallen back. ``group_size``: this group's own size (verl V1's
        ``__rollout_n__``), else ``rollout.n``. A session waits for its group's others at
        most ``wait_timeout`` seconds (DRACO_INLOOP; unbounded by default), and not at all
        once one of them failed: either way an error naming the group, what arrived and what
        did not."""
        from draco_cli.errors import InputError
        from draco_cli.inloop import TrainerRollout

        scorer = await self._get()
        r = TrainerRollout(**rollout)
        g = self._groups.setdefault((r.train_step, r.group_id), _Wait())
        g.size = g.size or int(group_size or self.group_size)
        await scorer.add(r, group_size=g.size)
        arrived = g.arrived
        arrived.append(r.rollout_id)
        if len(arrived) == g.size:
            g.done.set()
        wait = self.config.get("wait_timeout", DEFAULT_WAIT)
        try:
            await asyncio.wait_for(g.done.wait(), wait)  # others may still be generating
        except (asyncio.TimeoutError, TimeoutError):
            raise InputError(
                f"{r.where()}: group {r.group_id!r} of train step {r.train_step} has "
                f"{len(arrived)} of {g.size} sessions after waiting {wait:g} s "
                f"({', '.join(arrived)}); a session that never finishes leaves its group "
                f"short (raise wait_timeout in {ENV_SETTINGS} if sessions take longer)",
                field="group_id") from None
        if g.failed is not None:
            raise InputError(f"{r.where()}: group {r.group_id!r} of train step "
                             f"{r.train_step} will not be scored: {g.failed} "
                             f"(arrived: {', '.join(arrived)})", field="group_id")
        got = await scorer.advantages(r.rollout_id, r.train_step)
        return {"values": np.asarray(got.values, dtype=np.float32), "source": got.source,
                "credit_mode": got.credit_mode}

    async def member_failed(self, train_step: int | None, group: str, session: int,
                            reason: str) -> None:
        """A session of ``group`` raised before reaching the scorer: its siblings stop
        waiting for it (verl drops a group with a failed session)."""
        g = self._groups.setdefault((train_step, group), _Wait())
        g.failed = g.failed or f"its session {session} failed ({reason})"
        g.done.set()

    async def finish(self, train_step: int, groups: list[str]) -> dict[str, float]:
        """The batch's groups of one train step finished: metrics, audit folder written."""
        from draco_cli.inloop import write_step

        scorer = await self._get()
        result = await scorer.finish(train_step, groups=groups)
        for g in groups:
            self._groups.pop((train_step, g), None)
        # verl drops a group with a failed session from its batch: no finish will name it
        failed = [g for (step, g), w in self._groups.items()
                  if step == train_step and w.failed is not None]
        scorer.discard(train_step, failed)
        for g in failed:
            del self._groups[(train_step, g)]
        if self.config.get("audit_dir"):
            # an async batch holds part of a step: a later part joins the step's folder
            write_step(result, self.config["audit_dir"], keep=self.config.get("keep"),
                       add=train_step in self._written)
            self._written.add(train_step)
        return dict(result.metrics)

    async def close(self) -> None:
        if self._scorer is not None:
            await self._scorer.__aexit__(None, None, None)
            self._scorer = None


def scorer_handle(group_size: int, tokenizer: Any) -> Any:
    """The job's shared scorer actor, created by whichever worker asks first."""
    import ray

    config = settings()
    actor = ray.remote(num_cpus=0, max_concurrency=10_000)(DracoScorerActor)
    return actor.options(name=ACTOR_NAME, get_if_exists=True).remote(
        config, group_size, tokenizer)


def finish_groups(by_step: dict[int, set[str]]) -> dict[str, float]:
    """Called by the estimator (in the TaskRunner): finish each train step's groups of the
    batch in the shared actor; the metrics to log."""
    import ray

    if not by_step:
        return {}
    actor = ray.get_actor(ACTOR_NAME)
    metrics: dict[str, float] = {}
    for step in sorted(by_step):
        metrics = ray.get(actor.finish.remote(step, sorted(by_step[step])))
    metrics["draco/train_steps_in_batch"] = float(len(by_step))
    return metrics
