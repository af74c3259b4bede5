"""In-loop scoring for verl: agent-loop managers (``agent_loop_manager_class``) whose workers,
once a session's output and verl's reward for it exist, send it to the job's shared scorer and
put the advantages it returns in the output's ``extra_fields``, which verl carries with the row.
The legacy manager also passes ``session_id`` and ``global_steps``, which only V1 gives the
agent loop. See docs/trainers.md, "verl (0.9)"."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker
from verl.utils.ray_utils import auto_await

from draco_cli.trainers.verl.estimator import (
    ADV_FIELD,
    GROUP_FIELD,
    ROW_ID_FIELD,
    SOURCE_FIELD,
    STEP_FIELD,
    rollout_id,
)
from draco_cli.trainers.verl.scorer import scorer_handle

__all__ = ["DracoAgentLoopManager", "DracoAgentLoopManagerTQ", "DracoAgentLoopWorker",
           "DracoWorkerMixin", "add_sessions", "attach_advantages"]


def add_sessions(non_tensor: dict[str, Any], global_steps: int | None) -> None:
    """Legacy batch (repeated ``n`` times per prompt): each row's ``session_id`` (its place
    among the rows of its ``uid``) and ``global_steps``, as V1 passes them to the agent loop."""
    uids = non_tensor["uid"]
    if "session_id" not in non_tensor:
        seen: dict[str, int] = {}
        sessions = np.empty(len(uids), dtype=object)
        for b, u in enumerate(uids):
            sessions[b] = seen[str(u)] = seen.get(str(u), -1) + 1
        non_tensor["session_id"] = sessions
    if "global_steps" not in non_tensor and global_steps is not None:
        non_tensor["global_steps"] = np.array([int(global_steps)] * len(uids), dtype=object)


async def attach_advantages(scorer: Any, outputs: Sequence[Any], kwargs: dict[str, Any],
                            decode: Any, group_size: int | None = None) -> None:
    """Send the session's final output to the shared scorer; put the advantages it returns
    (and the row's id, group, step, source) in each output's ``extra_fields``.
    ``group_size``: the session's group's own size where the trainer set one."""
    uid, session = str(kwargs["uid"]), int(kwargs["session_id"])
    step = int(kwargs["global_steps"])
    final = outputs[-1]
    rid = rollout_id(uid, session, len(outputs) - 1)
    ref = scorer.score.remote({
        "rollout_id": rid, "group_id": uid, "instruction": decode(list(final.prompt_ids)),
        "response_ids": list(final.response_ids), "response_mask": list(final.response_mask),
        "outcome": None if final.reward_score is None else float(final.reward_score),
        "train_step": step}, group_size)
    try:
        got = await ref
    except ray.exceptions.RayTaskError as e:   # the scorer's own error, not Ray's wrapping
        raise e.as_instanceof_cause() from None
    for i, out in enumerate(outputs):
        last = i == len(outputs) - 1
        out.extra_fields.update({
            ADV_FIELD: got["values"] if last else np.zeros(len(out.response_ids), np.float32),
            ROW_ID_FIELD: rollout_id(uid, session, i), GROUP_FIELD: uid, STEP_FIELD: step,
            SOURCE_FIELD: got["source"] if last else "unscored"})


class DracoWorkerMixin:
    """Put before an AgentLoopWorker class: scores each training session's outputs in the
    job's shared scorer before verl pads (legacy) or stores (V1) them."""

    _draco_scorer: Any = None
    _draco_sizes: dict[str, int] | None = None
    config: Any
    tokenizer: Any

    def _draco(self) -> Any:
        if self._draco_scorer is None:
            n = int(self.config.actor_rollout_ref.rollout.n)
            self._draco_scorer = scorer_handle(n, self.tokenizer)
        return self._draco_scorer

    async def _run_prompt(self, prompt: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """V1: a prompt may set its own number of sessions (``__rollout_n__``, popped by
        verl before the sessions see it); the scorer waits for that many."""
        if "__rollout_n__" in prompt:
            if self._draco_sizes is None:
                self._draco_sizes = {}
            self._draco_sizes[str(prompt["uid"])] = int(prompt["__rollout_n__"])
        try:
            return await super()._run_prompt(prompt, *args, **kwargs)  # type: ignore[misc]
        finally:
            if self._draco_sizes is not None:
                self._draco_sizes.pop(str(prompt["uid"]), None)

    async def _run_agent_loop(self, sampling_params: Any, trajectory: dict[str, Any],
                              **kwargs: Any) -> Any:
        try:
            return await super()._run_agent_loop(  # type: ignore[misc]
                sampling_params, trajectory, **kwargs)
        except (Exception, asyncio.CancelledError) as e:
            # its group's other sessions wait for this one in the shared scorer: release them
            if not trajectory.get("validate") and "uid" in kwargs and "session_id" in kwargs:
                step = kwargs.get("global_steps")
                with contextlib.suppress(Exception):
                    await self._draco().member_failed.remote(
                        None if step is None else int(step), str(kwargs["uid"]),
                        int(kwargs["session_id"]), f"{type(e).__name__}: {e}"[:300])
            raise

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
        outputs = output if isinstance(output, list) else [output]
        if outputs and not validate:
            # verl's reward first (it skips outputs that already have one), so the outcome
            # reaches draco; verl's own postprocess below then finds it set.
            await self._compute_score(outputs, kwargs=kwargs)  # type: ignore[attr-defined]
            await attach_advantages(
                self._draco(), outputs, kwargs,
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                (self._draco_sizes or {}).get(str(kwargs["uid"])))
        return await super()._agent_loop_postprocess(  # type: ignore[misc]
            output, validate, **kwargs)


class DracoAgentLoopWorker(DracoWorkerMixin, AgentLoopWorker):  # type: ignore[misc]
    """verl's legacy AgentLoopWorker with draco's in-loop scoring."""


class DracoAgentLoopManager(AgentLoopManager):  # type: ignore[misc]
    """Legacy trainer: verl's AgentLoopManager with draco's workers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not hasattr(self, "agent_loop_workers_class"):
            self.agent_loop_workers_class = ray.remote(DracoAgentLoopWorker)
        super().__init__(*args, **kwargs)

    @auto_await  # type: ignore[untyped-decorator]
    async def generate_sequences(self, prompts: Any) -> Any:
        add_sessions(prompts.non_tensor_batch, prompts.meta_info.get("global_steps"))
        inner = AgentLoopManager.generate_sequences.__wrapped__
        return await inner(self, prompts)


def _tq_classes() -> tuple[type, type]:
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

    # AgentLoopWorkerTQ is a Ray actor class; subclass the class it was made from.
    base = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__bases__[0]
    worker = type("DracoAgentLoopWorkerTQ", (DracoWorkerMixin, base),
                  {"__module__": __name__, "__qualname__": "DracoAgentLoopWorkerTQ"})
    return worker, AgentLoopManagerTQ


try:
    DracoAgentLoopWorkerTQ, _ManagerTQ = _tq_classes()
except ImportError:  # an older verl without the V1 trainer (or without transfer_queue)
    DracoAgentLoopWorkerTQ, _ManagerTQ = None, AgentLoopManager  # type: ignore[assignment]


class DracoAgentLoopManagerTQ(_ManagerTQ):  # type: ignore[misc,valid-type]
    """V1 trainer (``trainer.use_v1``): verl's AgentLoopManagerTQ with draco's workers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # AgentLoopManagerTQ sets its own worker class first; ours replaces it.
        self.agent_loop_workers_class = ray.remote(DracoAgentLoopWorkerTQ)
