"""verl (0.9): draco's token advantages as a registered advantage estimator, keyed on per-row ids.

verl calls a registered estimator with ``index`` = the group ``uid`` only, after reordering the
batch (``balance_batch``), so the estimator alone cannot tell which rollout a row is. ``setup``
(usable as Ray's ``worker_process_setup_hook``, which runs in every Ray worker process, the
TaskRunner actor included) registers the ``draco`` estimator and wraps the two functions that
see the rows' identity just before they call it:

- V1 trainer (``trainer.use_v1``): ``compute_advantage_for_multi_trajectories`` receives the
  TransferQueue keys ``{uid}_{session_id}_{index}``. Row id: ``{uid}_{session_id}`` for output
  0, ``{uid}_{session_id}_{index}`` for a session's further outputs. Rows whose uid is verl's
  padding uid (``pad`` + 32 hex digits) are marked padding and get zeros.
- legacy trainer: ``compute_advantage`` receives the DataProto; the row id is the
  ``draco_rollout_id`` the agent loop put in ``extra_fields`` (copied by verl into
  ``non_tensor_batch``), ``responses`` gives the fingerprint check, and an optional
  ``draco_train_step`` extra field the train-step check.

Launch with::

    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=draco_cli.trainers.verl.setup
    +ray_kwargs.ray_init.runtime_env.env_vars.DRACO_TOKEN_ADVANTAGES=/runs/step-*/credit/token_advantages.parquet
    algorithm.adv_estimator=draco

``DRACO_TOKEN_ADVANTAGES`` is a glob (or several, separated by ``os.pathsep``) read afresh at
each call, so an async trainer whose batch mixes rollouts of several generation steps finds each
row in its own step's file.
"""

from __future__ import annotations

import glob
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from draco_cli.trainers.loader import AlignmentError, TokenAdvantageTable, load_token_advantages

ESTIMATOR = "draco"
ENV_FILES = "DRACO_TOKEN_ADVANTAGES"
ROW_ID_FIELD = "draco_rollout_id"  # legacy trainer: the agent loop's extra_fields key
STEP_FIELD = "draco_train_step"  # legacy trainer, optional: the train step the row claims
_PAD_UID = re.compile(r"pad[0-9a-f]{32}")

__all__ = [
    "ENV_FILES",
    "ESTIMATOR",
    "ROW_ID_FIELD",
    "STEP_FIELD",
    "draco_advantages",
    "rollout_id",
    "row_ids_from_keys",
    "setup",
]


@dataclass
class Rows:
    """Identity of the rows of the batch the estimator is about to see."""

    ids: list[str | None]
    padding: np.ndarray
    response_ids: np.ndarray | None = None
    train_step: list[int] | None = None


_current = threading.local()


def rollout_id(uid: str, session_id: int, index: int = 0) -> str:
    """The rollout id a verl V1 agent loop logs for its output ``index`` (kwargs ``uid`` and
    ``session_id``): ``{uid}_{session_id}``, with ``_{index}`` for a session's further outputs."""
    return f"{uid}_{session_id}" if index == 0 else f"{uid}_{session_id}_{index}"


def row_ids_from_keys(keys: Sequence[str]) -> Rows:
    """Per-row ids and padding marks from V1 TransferQueue keys ``{uid}_{session_id}_{index}``."""
    ids: list[str | None] = []
    pad = np.zeros(len(keys), dtype=bool)
    for b, key in enumerate(keys):
        fields = str(key).rsplit("_", 2)
        if len(fields) != 3 or not fields[1].isdigit() or not fields[2].isdigit():
            raise AlignmentError(f"trainer row {b}: key {key!r} is not {{uid}}_{{session}}_{{index}}")
        uid, session, index = fields[0], int(fields[1]), int(fields[2])
        if _PAD_UID.fullmatch(uid):
            pad[b] = True
            ids.append(None)
        else:
            ids.append(rollout_id(uid, session, index))
    return Rows(ids, pad)


def _files(paths: str | Sequence[str] | None = None) -> list[str]:
    spec = paths if paths is not None else os.environ.get(ENV_FILES)
    if not spec:
        raise AlignmentError(f"draco estimator: set {ENV_FILES} to this step's "
                             "token_advantages.parquet (a glob, or several joined by ':')")
    patterns = spec.split(os.pathsep) if isinstance(spec, str) else list(spec)
    found = sorted({f for p in patterns for f in (glob.glob(p) or [])})
    if not found:
        raise AlignmentError(f"draco estimator: no file matches {ENV_FILES}={spec!r}")
    return found


# verl calls the estimator with torch tensors (untyped to mypy here: torch is optional).
def draco_advantages(token_level_rewards: Any, response_mask: Any, config: Any = None,
                     index: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """The ``draco`` estimator: (advantages, returns), both draco's values, [B, T]."""
    import torch

    rows: Rows | None = getattr(_current, "rows", None)
    B = int(response_mask.shape[0])
    if rows is None:
        raise AlignmentError(
            "draco estimator: the batch's per-row ids are unknown; run "
            "draco_cli.trainers.verl.setup in this process (Ray worker_process_setup_hook)")
    if len(rows.ids) != B:
        raise AlignmentError(f"draco estimator: {len(rows.ids)} row ids for a batch of {B} rows")
    wanted = [i for i in rows.ids if i is not None]
    table: TokenAdvantageTable = load_token_advantages(_files(), rollout_ids=wanted)
    mask = response_mask.detach().cpu().numpy()
    adv = table.batch(rows.ids, mask, response_ids=rows.response_ids, padding=rows.padding,
                      train_step=rows.train_step)
    out = torch.as_tensor(adv, device=response_mask.device, dtype=token_level_rewards.dtype)
    return out, out.clone()


_T = TypeVar("_T")


def _with_rows(rows: Rows, call: Callable[[], _T]) -> _T:
    previous = getattr(_current, "rows", None)
    _current.rows = rows
    try:
        return call()
    finally:
        _current.rows = previous


def _wrap_v1(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "_draco", False):
        return fn

    def compute_advantage_for_multi_trajectories(data: Any, batch_keys: Any, adv_estimator: Any,
                                                  *args: Any, **kw: Any) -> Any:
        if adv_estimator != ESTIMATOR:
            return fn(data, batch_keys, adv_estimator, *args, **kw)
        return _with_rows(row_ids_from_keys(batch_keys),
                          lambda: fn(data, batch_keys, adv_estimator, *args, **kw))

    # marks (read back with getattr) that a function object does not declare
    compute_advantage_for_multi_trajectories._draco = True  # type: ignore[attr-defined]
    compute_advantage_for_multi_trajectories.__wrapped__ = fn  # type: ignore[attr-defined]
    return compute_advantage_for_multi_trajectories


def _wrap_legacy(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "_draco", False):
        return fn

    def compute_advantage(data: Any, adv_estimator: Any, *args: Any, **kw: Any) -> Any:
        if adv_estimator != ESTIMATOR or ROW_ID_FIELD not in data.non_tensor_batch:
            return fn(data, adv_estimator, *args, **kw)
        ids = [None if i is None else str(i) for i in data.non_tensor_batch[ROW_ID_FIELD]]
        batch = data.batch  # a TensorDict: membership through its keys
        responses = batch["responses"].cpu().numpy() if "responses" in batch.keys() else None  # noqa: SIM118
        steps = data.non_tensor_batch.get(STEP_FIELD)
        rows = Rows(ids, np.array([i is None for i in ids]), responses,
                    None if steps is None else [int(x) for x in steps])
        return _with_rows(rows, lambda: fn(data, adv_estimator, *args, **kw))

    # marks (read back with getattr) that a function object does not declare
    compute_advantage._draco = True  # type: ignore[attr-defined]
    compute_advantage.__wrapped__ = fn  # type: ignore[attr-defined]
    return compute_advantage


def setup() -> None:
    """Register the ``draco`` estimator and the per-row id wrappers in this process.

    Idempotent. Meant as Ray's ``worker_process_setup_hook``: a ``@register_adv_est`` in the
    launch script never reaches the TaskRunner actor, which runs in another process."""
    import sys

    from verl.trainer.ppo import core_algos, ray_trainer

    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR) is not draco_advantages:
        core_algos.register_adv_est(ESTIMATOR)(draco_advantages)
    ray_trainer.compute_advantage = _wrap_legacy(ray_trainer.compute_advantage)
    try:
        from verl.trainer.ppo.v1 import utils as v1_utils
    except ImportError:  # an older verl without the V1 trainer
        return
    v1_utils.compute_advantage = ray_trainer.compute_advantage
    v1_utils.compute_advantage_for_multi_trajectories = _wrap_v1(
        v1_utils.compute_advantage_for_multi_trajectories)
    # Modules that bound the name before the hook ran (imported with ``from ... import``).
    base = sys.modules.get("verl.trainer.ppo.v1.trainer_base")
    if base is not None:
        setattr(base, "compute_advantage_for_multi_trajectories",  # noqa: B010 - a ModuleType to mypy
                v1_utils.compute_advantage_for_multi_trajectories)


def registered() -> bool:
    """True when ``setup`` ran in this process (for checks from a Ray actor)."""
    from verl.trainer.ppo import core_algos

    return core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR) is draco_advantages
