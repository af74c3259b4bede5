"""SkyRL (skyrl-train 0.3.1; newest code: ``skyrl.train``): draco's per-token advantages in
SkyRL's dense layout, through ``DracoGenerator`` and the ``draco`` estimator. See
docs/trainers.md, "SkyRL". Step-wise mode is refused: SkyRL's trainer broadcasts the last step's
advantage to every step (SkyRL #1492), whatever a hook does."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from draco_cli.errors import InputError, UsageError
from draco_cli.inloop.rows import TrainerRollout
from draco_cli.trainers import field_of
from draco_cli.trainers.skyrl_rows import Deliveries, outcome_of, trajectory

if TYPE_CHECKING:
    from draco_cli.inloop import BlockingStepScorer

__all__ = ["ESTIMATOR", "Deliveries", "DracoGenerator", "draco_estimator",
           "register_estimator", "row_ids"]

ESTIMATOR = "draco"
_PAD = re.compile(r"pad\d+$")   # the uids SkyRL's pad_batch gives the rows it appends
# Settings under which SkyRL changes the values between the estimator and the loss, or the
# rewards between the generator and the estimator: draco's numbers would not be the trained ones.
_REFUSED = {"use_kl_in_reward": "adds a KL penalty to the rewards before the estimator",
            "advantage_batch_normalize": "re-standardises the advantages over the batch"}


def row_ids(input_batch: Mapping[str, Any], output: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Each output row's (row id, group uid). SkyRL's trainer takes the uids from the input
    order; a generator that also returns ``trajectory_ids`` must agree with it row by row."""
    given = input_batch.get("trajectory_ids")
    n = len(output["response_ids"])
    if given is None:
        raise UsageError("the generator input has no trajectory_ids: draco needs them for the "
                         "rollout and group ids (SkyRL's prepare_generator_input sets them)")
    ids = [trajectory(t) for t in given]
    if len(ids) != n:
        raise InputError(f"the generator returned {n} rows for {len(ids)} trajectories",
                         field="response_ids")
    back = output.get("trajectory_ids")
    if back is not None:
        for i, (t, (rid, _)) in enumerate(zip(back, ids)):
            if trajectory(t)[0] != rid:
                raise InputError(f"generator row {i} is trajectory {trajectory(t)[0]!r} but "
                                 f"the trainer's uids put {rid!r} there: SkyRL expects rows "
                                 "in input order", field="trajectory_ids")
    return ids


class DracoGenerator:
    """SkyRL generator whose training batches carry draco's per-token values as ``rewards``.

    ``inner`` is the generator to wrap (``SkyRLGymGenerator`` or any ``GeneratorInterface``);
    ``scorer`` a ``BlockingStepScorer`` with ``group_size`` = ``n_samples_per_prompt``;
    ``decode`` token ids → text (the tokenizer's decode), for the task text. Evaluation batches
    pass through unchanged. ``steps_dir`` keeps each step's tables for audit (``write_step``)."""

    def __init__(self, inner: Any, scorer: BlockingStepScorer, *,
                 decode: Callable[[list[int]], str], deliveries: Deliveries | None = None,
                 steps_dir: str | Path | None = None, keep_steps: int | None = None) -> None:
        self.inner, self.scorer, self.decode = inner, scorer, decode
        self.deliveries = deliveries if deliveries is not None else Deliveries()
        # resolved now: SkyRL's workers may change directory before the first step is written
        self.steps_dir = None if steps_dir is None else Path(steps_dir).resolve()
        self.keep_steps = keep_steps

    def __getattr__(self, name: str) -> Any:
        # SkyRL's trainer and generators reach for inner attributes (e.g. the env config)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = dict(await self.inner.generate(input_batch))
        meta = input_batch.get("batch_metadata")
        if meta is not None and getattr(meta, "training_phase", "train") == "eval":
            return out   # eval metrics read the environment's rewards
        last = out.get("is_last_step")
        if last is not None and not all(last):
            raise UsageError("SkyRL step-wise mode (generator.step_wise_trajectories) broadcasts "
                             "the last step's advantage to every step (SkyRL #1492): draco's "
                             "per-step values cannot survive it; train non-step-wise")
        step = None if meta is None else int(meta.global_step)
        rows = self.rollouts(input_batch, out, step)
        result = await asyncio.to_thread(self.scorer.score_step, rows, step)
        rewards = []
        for r in rows:
            v = result.rows[r.rollout_id].values
            if len(v) != len(r.response_ids):
                raise InputError(f"{r.where()}: draco gave {len(v)} values for "
                                 f"{len(r.response_ids)} response tokens", field="rewards")
            rewards.append(v.astype(np.float32).tolist())
            self.deliveries.add(r.group_id, r.rollout_id, np.asarray(v, dtype=np.float32))
        out["rewards"] = rewards
        out["rollout_metrics"] = {**(out.get("rollout_metrics") or {}), **result.metrics}
        if self.steps_dir is not None:
            from draco_cli.inloop import write_step

            write_step(result, self.steps_dir, keep=self.keep_steps)
        return out

    def rollouts(self, input_batch: Mapping[str, Any], out: Mapping[str, Any],
                 step: int | None) -> list[TrainerRollout]:
        ids = row_ids(input_batch, out)
        return [TrainerRollout(rid, uid, self.decode(list(out["prompt_token_ids"][i])),
                               out["response_ids"][i], out["loss_masks"][i],
                               outcome=outcome_of(out["rewards"][i]), task_id=uid,
                               train_step=step, row=i)
                for i, (rid, uid) in enumerate(ids)]


def _check_config(config: Any) -> None:
    for key, why in _REFUSED.items():
        if config is not None and bool(field_of(config, key)):
            raise UsageError(f"trainer.algorithm.{key}=true {why}: the trained advantages would "
                             "not be draco's; set it to false with the draco estimator")


def draco_estimator(deliveries: Deliveries) -> Callable[..., tuple[Any, Any]]:
    """The estimator function for ``deliveries`` (SkyRL's estimator signature): returns
    ``(rewards * response_mask, same)`` as (advantages, returns) after checking every row."""

    def draco_advantages(*, token_level_rewards: Any, response_mask: Any, index: Sequence[str],
                         config: Any = None, **_: Any) -> tuple[Any, Any]:
        _check_config(config)
        delivered = deliveries.take()
        if not delivered:
            raise UsageError("the draco advantage estimator ran but DracoGenerator delivered no "
                             "rows since its last call: wrap the trainer's generator in "
                             "draco_cli.trainers.skyrl.DracoGenerator")
        rewards = token_level_rewards.detach().float().cpu().numpy()
        mask = response_mask.detach().cpu().numpy() != 0
        check_rows(rewards, mask, [str(u) for u in index], delivered)
        adv = token_level_rewards * response_mask.to(token_level_rewards.dtype)
        return adv, adv.clone()

    return draco_advantages


def check_rows(rewards: np.ndarray, mask: np.ndarray, index: list[str],
               delivered: dict[str, list[tuple[str, np.ndarray]]]) -> None:
    """Every non-padding row of the estimator's batch must be a delivered row of its group:
    same length (response mask) and the very values; nothing past the response."""
    B = rewards.shape[0]
    if len(index) != B:
        raise InputError(f"estimator: {len(index)} uids for {B} rows", field="index")
    pads = 0
    while pads < B and _PAD.match(index[B - 1 - pads]) and index[B - 1 - pads] not in delivered:
        pads += 1
    for b in range(B - pads):
        uid, L = index[b], int(mask[b].sum())
        if mask[b, L:].any() or np.any(rewards[b, L:] != 0):
            raise InputError(f"estimator row {b} (group {uid!r}): values past its {L} response "
                             "tokens", field="rewards")
        group = delivered.get(uid)
        if group is None:
            raise InputError(f"estimator row {b}: group {uid!r} has no rows draco delivered "
                             "this step", field="index")
        same_len = [(rid, v) for rid, v in group if len(v) == L]
        if not same_len:
            raise InputError(f"estimator row {b} (group {uid!r}): {L} response tokens, but "
                             f"draco delivered rows of {sorted({len(v) for _, v in group})} "
                             "tokens: a length mismatch", field="rewards")
        if not any(np.array_equal(rewards[b, :L], v) for _, v in same_len):
            raise InputError(f"estimator row {b} (group {uid!r}): its rewards are none of the "
                             f"values draco delivered for that group ({', '.join(r for r, _ in same_len)}): "
                             "they were changed or moved between rows after delivery",
                             field="rewards")


def register_estimator(deliveries: Deliveries, name: str = ESTIMATOR) -> str:
    """Register the draco estimator in SkyRL's ``AdvantageEstimatorRegistry`` (once per
    process; set ``trainer.algorithm.advantage_estimator`` to ``name``)."""
    try:
        from skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry
    except ImportError:
        try:
            from skyrl.backends.skyrl_train.utils.ppo_utils import (  # newest SkyRL layout
                AdvantageEstimatorRegistry,
            )
        except ImportError:
            raise UsageError("the SkyRL estimator needs skyrl-train (see docs/trainers.md, "
                             "SkyRL)") from None
    if name in AdvantageEstimatorRegistry.list_available():
        AdvantageEstimatorRegistry.unregister(name)
    AdvantageEstimatorRegistry.register(name, draco_estimator(deliveries))
    return name
