"""slime's rollout records: the samples of one rollout step, as slime saves and holds them.

``--save-debug-rollout-data`` (``--dump-details DIR``: ``DIR/rollout_data/{rollout_id}.pt``)
``torch.save``s ``{"rollout_id": N, "samples": [Sample.to_dict(), ...]}`` each step
(``slime/observability/rollout_data_utils.py`` at 624b824a). A sample becomes rollout
``str(index)`` in group ``str(group_index)``, its response ``tokens[-response_length:]`` with
``loss_mask`` (None = all 1) as the policy mask. See docs/trainers.md, "slime".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.errors import InputError
from draco_cli.trainers import field_of


def load_dump(path: Path) -> tuple[int | None, list[dict[str, Any]]]:
    """(rollout_id, samples) of a ``--save-debug-rollout-data`` file, read without running
    pickled code (``weights_only``): a dump holding other objects is refused, not executed."""
    import pickle

    import torch

    if not path.is_file():
        raise InputError("no such file", file=str(path))
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"not a slime rollout dump readable as plain data ({first})",
                         file=str(path)) from None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise InputError("not a slime rollout dump: expected {'rollout_id': N, 'samples': "
                         "[...]} as --save-debug-rollout-data writes", file=str(path))
    step = data.get("rollout_id")
    return (int(step) if isinstance(step, int) else None), data["samples"]


def _ids(value: Any, name: str, where: str) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    arr = np.asarray([] if value is None else value)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InputError(f"{where}: {name} must be a flat list of integers", field=name)
    return arr.astype(np.int64)


def reward_of(sample: Any, where: str, reward_key: str | None = None) -> float | None:
    reward = field_of(sample, "reward")
    if isinstance(reward, dict):
        if reward_key is None or reward_key not in reward:
            raise InputError(f"{where}: reward is a dict ({', '.join(map(str, reward))}); "
                             "slime reads it through --reward-key, name the key",
                             field="reward")
        reward = reward[reward_key]
    if reward is None:
        return None
    try:
        out = float(reward)
    except (TypeError, ValueError):
        raise InputError(f"{where}: reward {reward!r} is not a number", field="reward") from None
    if not np.isfinite(out):
        raise InputError(f"{where}: reward {reward!r} is not finite", field="reward")
    return out


def sample_rollout(sample: Any, *, where: str, decode: Callable[[list[int]], str],
                   train_step: int | None, row: int | None = None,
                   reward_key: str | None = None, keep_removed: bool = False) -> Any:
    """One slime sample as a ``TrainerRollout``; None for a ``remove_sample`` one (slime
    zeroes its loss mask when it builds the training data: nothing to credit) unless
    ``keep_removed``, which keeps its group whole for a group-relative score."""
    from draco_cli.inloop import TrainerRollout

    if field_of(sample, "remove_sample", False) and not keep_removed:
        return None
    index, group = field_of(sample, "index"), field_of(sample, "group_index")
    if not isinstance(index, int) or not isinstance(group, int):
        raise InputError(f"{where}: index {index!r} and group_index {group!r} must be "
                         "integers (slime's data source numbers every sample)", field="index")
    tokens = _ids(field_of(sample, "tokens"), "tokens", where)
    n = field_of(sample, "response_length")
    if not isinstance(n, int) or not 0 < n <= len(tokens):
        raise InputError(f"{where}: response_length {n!r} for {len(tokens)} tokens",
                         field="response_length")
    mask_value = field_of(sample, "loss_mask")
    mask = np.ones(n, dtype=np.int64) if mask_value is None else _ids(mask_value, "loss_mask",
                                                                       where)
    if len(mask) != n:
        raise InputError(f"{where}: loss_mask has {len(mask)} entries for a response of {n} "
                         "tokens", field="loss_mask")
    prompt_ids = tokens[: len(tokens) - n].tolist()
    return TrainerRollout(
        rollout_id=str(index), group_id=str(group), instruction=decode(prompt_ids),
        response_ids=tokens[len(tokens) - n:], response_mask=mask,
        outcome=reward_of(sample, where, reward_key), task_id=str(group),
        train_step=train_step, row=row)


def dump_rollouts(path: Path, *, decode: Callable[[list[int]], str], train_step: int | None,
                  reward_key: str | None = None) -> Iterator[tuple[int, Any]]:
    """(position, TrainerRollout or None) of each sample of one dump; the step is the dump's
    ``rollout_id`` unless ``train_step`` is given."""
    step, samples = load_dump(path)
    step = train_step if train_step is not None else step
    for i, s in enumerate(samples):
        if not isinstance(s, dict):
            raise InputError("not a sample dict (Sample.to_dict())", file=str(path), row=i)
        yield i, sample_rollout(s, where=f"{path}: sample {i}", decode=decode,
                                train_step=step, row=i, reward_key=reward_key)
