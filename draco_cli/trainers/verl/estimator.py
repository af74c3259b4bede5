"""verl (0.9): the ``draco`` advantage estimator and the wrappers that tell it which row is which.

verl hands a registered estimator only the group ``uid`` (``index``), after reordering the batch
(``_balance_batch``), so ``setup`` also wraps the functions that see each row just before it:
they pass on the row's own values (in the loop) or its id (file route). See docs/trainers.md,
"verl (0.9)".
"""

from __future__ import annotations

import functools
import glob
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from draco_cli.trainers.loader import AdvantageFiles, AlignmentError

ESTIMATOR = "draco"
ENV_FILES = "DRACO_TOKEN_ADVANTAGES"
ROW_ID_FIELD = "draco_rollout_id"  # legacy trainer: the agent loop's extra_fields key
STEP_FIELD = "draco_train_step"  # legacy trainer, optional: the train step the row claims
ADV_FIELD = "draco_advantages"  # in-loop: the row's own per-token advantages (float32)
SOURCE_FIELD = "draco_source"  # in-loop: draco, fallback:outcome, fallback:zero, unscored
GROUP_FIELD = "draco_group"  # in-loop: the group (verl's uid) the row was scored in
METRICS_KEY = "draco_metrics"  # legacy: DataProto.meta_info key the metrics travel under
_PAD_UID = re.compile(r"pad[0-9a-f]{32}")


@dataclass
class Rows:
    """Identity of the rows of the batch the estimator is about to see."""

    ids: list[str | None]
    padding: np.ndarray
    response_ids: np.ndarray | None = None
    train_step: list[int] | None = None
    values: list[Any] | None = None  # in-loop: each row's own advantages (None: padding)
    groups: list[str | None] | None = None  # in-loop: each row's group


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


def _files() -> list[str]:
    spec = os.environ.get(ENV_FILES)
    if not spec:
        raise AlignmentError(f"draco estimator: set {ENV_FILES} to this step's "
                             "token_advantages.parquet (a glob, or several joined by ':')")
    found = sorted({f for p in spec.split(os.pathsep) for f in glob.glob(p)})
    if not found:
        raise AlignmentError(f"draco estimator: no file matches {ENV_FILES}={spec!r}")
    return found


# the files of DRACO_TOKEN_ADVANTAGES, read once each, held while batches need them
_files_read = AdvantageFiles()


def _row_values(rows: Rows, mask: np.ndarray) -> np.ndarray:
    """In-loop: each row's own advantages, right-padded to the response width; padding rows 0.
    A row without values, longer than the width or with values on masked tokens is an error."""
    assert rows.values is not None
    B, T = mask.shape
    out = np.zeros((B, T), dtype=np.float32)
    for b, v in enumerate(rows.values):
        if rows.padding[b]:
            continue
        where = f"rollout {rows.ids[b]!r} (trainer row {b})"
        if v is None:
            raise AlignmentError(f"{where}: no {ADV_FIELD} in the row (was the draco agent-loop "
                                 "manager configured for this run?)")
        a = np.asarray(v, dtype=np.float32).reshape(-1)
        if a.size > T:
            raise AlignmentError(f"{where}: {a.size} advantages for a response width of {T}")
        out[b, :a.size] = a
        stray = int(np.count_nonzero(out[b] * (mask[b] == 0)))
        if stray:
            raise AlignmentError(f"{where}: advantages on {stray} tokens the response mask "
                                 "excludes: the row's advantages are not for these tokens")
    return out


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
    mask = response_mask.detach().cpu().numpy()
    if rows.values is not None:
        adv = _row_values(rows, mask)
    else:
        wanted = [i for i in rows.ids if i is not None]
        table = _files_read.load(_files(), wanted)
        steps = rows.train_step
        if steps is not None:   # checked where the file records a step
            steps = [s if i is None or i not in table or table.train_step(i) is not None else -1
                     for s, i in zip(steps, rows.ids)]
        adv = table.batch(rows.ids, mask, response_ids=rows.response_ids, padding=rows.padding,
                          train_step=steps)
    out = torch.as_tensor(adv, device=response_mask.device, dtype=token_level_rewards.dtype)
    return out, out.clone()


def _inloop_metrics(rows: Rows) -> dict[str, float]:
    """Finish the batch's groups in the shared scorer; its ``draco/...`` metrics (the last
    train step's where a batch mixes several, plus ``draco/train_steps_in_batch``)."""
    from draco_cli.trainers.verl.scorer import finish_groups

    by_step: dict[int, set[str]] = {}
    for g, s, pad in zip(rows.groups or [], rows.train_step or [], rows.padding.tolist()):
        if g is not None and not pad:
            by_step.setdefault(int(s), set()).add(g)
    return finish_groups(by_step)


def _inloop_rows(ids: list[str | None], padding: np.ndarray, extra: Sequence[Any]) -> Rows | None:
    """Rows carrying their own advantages (the draco agent-loop manager ran), else None."""
    if not any(isinstance(e, dict) and ADV_FIELD in e
               for e, p in zip(extra, padding.tolist()) if not p):
        return None
    values, groups, steps = [], [], []
    for e, p in zip(extra, padding.tolist()):
        e = e if isinstance(e, dict) and not p else {}
        values.append(e.get(ADV_FIELD))
        groups.append(None if e.get(SOURCE_FIELD) == "unscored" else e.get(GROUP_FIELD))
        steps.append(int(e.get(STEP_FIELD, -1)))
    return Rows(ids, padding, values=values, groups=groups, train_step=steps)


_T = TypeVar("_T")
_Fn = Callable[..., Any]


def _once(wrap: Callable[[_Fn], _Fn]) -> Callable[[_Fn], _Fn]:
    """``wrap`` installed once: given a function it already wrapped (``setup()`` called again),
    it returns that function as it is."""
    @functools.wraps(wrap)
    def install(fn: _Fn) -> _Fn:
        if getattr(fn, "_draco", False):
            return fn
        wrapped = wrap(fn)
        # marks (read back with getattr) that a function object does not declare
        wrapped._draco = True  # type: ignore[attr-defined]
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    return install


def _with(name: str, value: Any, call: Callable[[], _T]) -> _T:
    """``call()`` with ``_current.<name>`` set to ``value``, then back to what it was."""
    previous = getattr(_current, name, None)
    setattr(_current, name, value)
    try:
        return call()
    finally:
        setattr(_current, name, previous)


@_once
def _wrap_v1(fn: Callable[..., Any]) -> Callable[..., Any]:
    def compute_advantage_for_multi_trajectories(data: Any, batch_keys: Any, adv_estimator: Any,
                                                  *args: Any, **kw: Any) -> Any:
        if adv_estimator != ESTIMATOR:
            return fn(data, batch_keys, adv_estimator, *args, **kw)
        rows = row_ids_from_keys(batch_keys)
        fetched: _V1Fields | None = getattr(_current, "v1", None)
        if fetched is not None and len(fetched.extra) == len(rows.ids):
            inloop = _inloop_rows(rows.ids, rows.padding, fetched.extra)
            if inloop is not None:
                rows = inloop
                out = _with("rows", rows, lambda: fn(data, batch_keys, adv_estimator, *args, **kw))
                fetched.metrics = _inloop_metrics(rows)
                return out
            T = int(data.batch["response_mask"].shape[1])
            rows.response_ids = _padded(fetched.responses, T)
            rows.train_step = fetched.global_steps
        return _with("rows", rows, lambda: fn(data, batch_keys, adv_estimator, *args, **kw))

    return compute_advantage_for_multi_trajectories


@dataclass
class _V1Fields:
    """What the V1 trainer's ``_compute_advantage`` leaves in the TransferQueue for the rows of
    the batch, in batch order: extra fields, response ids, the step each prompt was drawn at."""

    extra: list[Any]
    responses: list[Any]
    global_steps: list[int] | None
    metrics: dict[str, float] | None = None


def _padded(responses: Sequence[Any], T: int) -> np.ndarray:
    out = np.zeros((len(responses), T), dtype=np.int64)
    for b, r in enumerate(responses):
        a = np.asarray(r.cpu().numpy() if hasattr(r, "cpu") else r, dtype=np.int64).reshape(-1)
        out[b, :min(T, a.size)] = a[:T]
    return out


def _listed(td: Any, name: str) -> list[Any] | None:
    if name not in td.keys():  # noqa: SIM118 - a TensorDict
        return None
    v = td[name]
    if hasattr(v, "is_nested") and v.is_nested:
        return list(v.unbind(0))
    return list(v.tolist()) if hasattr(v, "tolist") else list(v)


def v1_fields(keys: Sequence[str], partition_id: str) -> _V1Fields:
    """The rows' extra fields, responses and global steps from the TransferQueue."""
    import transfer_queue as tq

    td = tq.kv_batch_get(keys=list(keys), partition_id=partition_id,
                         select_fields=["extra_fields", "responses", "global_steps"])
    steps = _listed(td, "global_steps")
    return _V1Fields(_listed(td, "extra_fields") or [None] * len(keys),
                     _listed(td, "responses") or [],
                     None if steps is None else [int(x) for x in steps])


@_once
def _wrap_v1_trainer(fn: Callable[..., Any]) -> Callable[..., Any]:
    def _compute_advantage(self: Any, batch: Any, metrics: dict[str, Any]) -> Any:
        if self.config.algorithm.adv_estimator != ESTIMATOR:
            return fn(self, batch, metrics=metrics)
        fetched = v1_fields(batch.keys, batch.partition_id)
        out = _with("v1", fetched, lambda: fn(self, batch, metrics=metrics))
        if fetched.metrics:
            metrics.update(fetched.metrics)   # verl's own per-step metrics, to its logger
        return out

    return _compute_advantage


@_once
def _wrap_data_metrics(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Legacy trainer: ``compute_data_metrics(batch=...)`` feeds verl's logger each step; the
    draco metrics the estimator left in ``batch.meta_info`` join them."""
    def compute_data_metrics(batch: Any, *args: Any, **kw: Any) -> Any:
        out = fn(batch, *args, **kw)
        extra = batch.meta_info.get(METRICS_KEY)
        if extra:
            out.update(extra)
        return out

    return compute_data_metrics


@_once
def _wrap_legacy(fn: Callable[..., Any]) -> Callable[..., Any]:
    def compute_advantage(data: Any, adv_estimator: Any, *args: Any, **kw: Any) -> Any:
        if adv_estimator != ESTIMATOR or ROW_ID_FIELD not in data.non_tensor_batch:
            return fn(data, adv_estimator, *args, **kw)
        ids = [None if i is None else str(i) for i in data.non_tensor_batch[ROW_ID_FIELD]]
        if ADV_FIELD in data.non_tensor_batch:
            nt = data.non_tensor_batch
            extra = [{k: nt[k][b] for k in (ADV_FIELD, GROUP_FIELD, STEP_FIELD, SOURCE_FIELD)
                      if k in nt} for b in range(len(ids))]
            inloop = _inloop_rows(ids, np.zeros(len(ids), dtype=bool), extra)
            if inloop is not None:
                out = _with("rows", inloop, lambda: fn(data, adv_estimator, *args, **kw))
                out.meta_info[METRICS_KEY] = _inloop_metrics(inloop)
                return out
        batch = data.batch  # a TensorDict: membership through its keys
        responses = batch["responses"].cpu().numpy() if "responses" in batch.keys() else None  # noqa: SIM118
        steps = data.non_tensor_batch.get(STEP_FIELD)
        rows = Rows(ids, np.array([i is None for i in ids]), responses,
                    None if steps is None else [int(x) for x in steps])
        return _with("rows", rows, lambda: fn(data, adv_estimator, *args, **kw))

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
    ray_trainer.compute_data_metrics = _wrap_data_metrics(ray_trainer.compute_data_metrics)
    try:
        from verl.trainer.ppo.v1 import trainer_base
        from verl.trainer.ppo.v1 import utils as v1_utils
    except ImportError:  # an older verl without the V1 trainer
        return
    trainer_base.PPOTrainer._compute_advantage = _wrap_v1_trainer(
        trainer_base.PPOTrainer._compute_advantage)
    v1_utils.compute_advantage = ray_trainer.compute_advantage
    v1_utils.compute_advantage_for_multi_trajectories = _wrap_v1(
        v1_utils.compute_advantage_for_multi_trajectories)
    # Modules that bound the name before the hook ran (imported with ``from ... import``).
    base = sys.modules.get("verl.trainer.ppo.v1.trainer_base")
    if base is not None:
        setattr(base, "compute_advantage_for_multi_trajectories",  # noqa: B010 - a ModuleType to mypy
                v1_utils.compute_advantage_for_multi_trajectories)
