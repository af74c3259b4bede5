"""An rLLM trajectory as draco sees it: one rollout whose response is its steps' tokens laid end to
end, each step's span kept so the values cut back into per-step lists (docs/trainers.md, "rLLM";
read at 9beb6e0f). Works on rLLM's own objects and on their saved dicts alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from draco_cli.errors import InputError
from draco_cli.inloop.rows import TrainerRollout
from draco_cli.trainers import field_of
from draco_cli.trainers.loader import fingerprint

__all__ = ["TrajectoryLayout", "field_of", "group_id_of", "layout_of", "step_values"]


@dataclass(frozen=True)
class TrajectoryLayout:
    """Where each rLLM step's response tokens sit in draco's rollout of the trajectory."""

    rollout_id: str           # the trajectory's uid
    step_ids: tuple[str | None, ...]
    spans: tuple[tuple[int, int], ...]   # per step, half-open [start, end) in response_ids
    response_ids: np.ndarray
    response_mask: np.ndarray

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.response_ids)

    def rollout(self, *, group_id: str, instruction: str, outcome: float | None,
                task_id: str | None = None, train_step: int | None = None,
                row: int | None = None) -> TrainerRollout:
        return TrainerRollout(self.rollout_id, group_id, instruction, self.response_ids,
                              self.response_mask, outcome=outcome, task_id=task_id,
                              train_step=train_step, row=row)


def _token_list(value: Any, what: str, where: str) -> list[int]:
    if value is None:
        return []
    try:
        out = [int(t) for t in value]
    except (TypeError, ValueError):
        raise InputError(f"{where}: {what} holds entries that are not token ids (multimodal "
                         "prompts are not supported)", field=what) from None
    if any(isinstance(t, bool) for t in value):
        raise InputError(f"{where}: {what} holds booleans, not token ids", field=what)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def where_of(traj: Any, step: int | None = None) -> str:
    text = f"trajectory {field_of(traj, 'uid')!r}"
    if step is not None:
        sid = field_of(field_of(traj, "steps")[step], "id")
        text += f" step {step + 1}" + (f" (id {sid!r})" if sid is not None else "")
    return text


def layout_of(traj: Any) -> TrajectoryLayout:
    """The response draco scores for ``traj`` and each step's span in it (docs/trainers.md,
    "rLLM")."""
    uid = field_of(traj, "uid")
    if not isinstance(uid, str) or not uid:
        raise InputError(f"trajectory {uid!r}: needs a string uid (rLLM's Trajectory.uid), "
                         "the id its advantages are matched by", field="uid")
    steps = field_of(traj, "steps") or []
    if not steps:
        raise InputError(f"{where_of(traj)}: no steps", field="steps")
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    seq: list[int] = []
    for k, step in enumerate(steps):
        where = where_of(traj, k)
        prompt = _token_list(field_of(step, "prompt_ids"), "prompt_ids", where)
        response = _token_list(field_of(step, "response_ids"), "response_ids", where)
        if k:
            cut = len(seq) if prompt[:len(seq)] == seq else _common_prefix(seq, prompt)
            ids += prompt[cut:]
        spans.append((len(ids), len(ids) + len(response)))
        ids += response
        seq = prompt + response
    if not ids or all(s == e for s, e in spans):
        raise InputError(f"{where_of(traj)}: no response token ids in any step (rLLM keeps "
                         "token ids only for training rollouts)", field="response_ids")
    mask = np.zeros(len(ids), dtype=np.int8)
    for s, e in spans:
        mask[s:e] = 1
    step_ids = tuple(None if field_of(s, "id") is None else str(field_of(s, "id"))
                     for s in steps)
    return TrajectoryLayout(uid, step_ids, tuple(spans), np.asarray(ids, dtype=np.int64), mask)


def step_values(layout: TrajectoryLayout, values: np.ndarray) -> list[list[float]]:
    """draco's dense values of the trajectory's response → one list per step, over exactly
    that step's ``response_ids`` (observation tokens dropped)."""
    if len(values) != len(layout.response_ids):
        raise InputError(f"trajectory {layout.rollout_id!r}: draco has {len(values)} token "
                         f"advantages, its response has {len(layout.response_ids)} tokens",
                         field="advantage")
    flat = np.asarray(values, dtype=np.float32)
    return [flat[s:e].tolist() for s, e in layout.spans]


def check_same(traj: Any, scored: TrajectoryLayout) -> TrajectoryLayout:
    """The trajectory as it is now must be the one draco scored: same steps, in the same
    order, with the same token ids; an error naming the first step that differs."""
    now = layout_of(traj)
    if len(now.spans) != len(scored.spans):
        raise InputError(f"{where_of(traj)}: has {len(now.spans)} steps, draco scored "
                         f"{len(scored.spans)}", field="steps")
    for k, (a, b, ia, ib) in enumerate(zip(now.spans, scored.spans, now.step_ids,
                                            scored.step_ids)):
        if ia != ib:
            raise InputError(f"{where_of(traj, k)}: draco scored step id {ib!r} at this "
                             "position (steps reordered or swapped)", field="id")
        if a[1] - a[0] != b[1] - b[0]:
            raise InputError(f"{where_of(traj, k)}: has {a[1] - a[0]} response tokens, draco "
                             f"scored {b[1] - b[0]} (rLLM would zero this step's advantage "
                             "with a warning; draco refuses)", field="response_ids")
    if now.fingerprint != scored.fingerprint:
        raise InputError(f"{where_of(traj)}: token ids differ from those draco scored "
                         f"(fingerprint {now.fingerprint}, scored {scored.fingerprint})",
                         field="response_ids")
    return now


def group_id_of(episode_id: str, traj_name: str) -> str:
    """rLLM's group key: the episode's task id (its id before ':') and the trajectory name,
    as its default grouping hook forms ``TrajectoryGroup.group_id``."""
    return f"{episode_id.split(':')[0]}:{traj_name}"


def instruction_of(task: Any, fallback: Sequence[Any] = ()) -> str:
    """The task text: a string task, a task dict's instruction/question/prompt/problem, else
    the first user message of the first step's chat."""
    if isinstance(task, str):
        return task
    for key in ("instruction", "question", "prompt", "problem"):
        value = field_of(task, key) if task is not None else None
        if isinstance(value, str) and value:
            return value
    for msg in fallback:
        if field_of(msg, "role") == "user" and isinstance(field_of(msg, "content"), str):
            return str(field_of(msg, "content"))
    return "" if task is None else str(task)
