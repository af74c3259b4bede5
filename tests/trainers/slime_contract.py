"""slime's structures as the draco adapter relies on them (THUDM/slime at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515; slime is not on the package index).

Where slime's own code is importable (its source on ``PYTHONPATH``, as in the recorded run of
docs/decisions.md) the samples are its own ``Sample`` objects, saved by its own
``save_debug_rollout_data``, and the training side is its own
``compute_advantages_and_returns``; otherwise this contract stands in, faithful to what that
commit's code does:

- ``Sample.to_dict()``: ``tokens`` = prompt + response ids, ``response_length``,
  ``loss_mask`` over the response, ``index`` (run-wide counter), ``group_index`` (one per
  prompt), ``reward``, ``remove_sample``, ``status`` as its string value (types.py);
- the dump: ``torch.save({"rollout_id": N, "samples": [...]})`` (rollout_data_utils.py);
- the training side's ``rollout_data`` of one data-parallel rank: the samples of its
  ``partition`` (slime's DP schedule, which reorders them) with ``tokens`` (long tensors),
  ``loss_masks`` (int tensors), ``response_lengths``, ``total_lengths``, ``sample_indices``,
  ``rollout_ids``, ``rewards``, and ``kl`` (float tensors over this CP rank's part of the
  response) — rollout.py ``_convert_samples_to_train_data`` / ``_split_train_data_by_dp``,
  data.py ``process_rollout_data``, actor.py ``_get_rollout_data``, loss.py;
- the CP cut (cp_utils.py): the sequence in ``2 * cp_size`` chunks of
  ``ceil(total / (2 * cp_size))``; rank r holds chunks r and ``2 * cp_size - 1 - r``; response
  token j is held where the logit predicting it (position P + j - 1) lies, chunk r's first.
  ``zigzag`` below computes that from chunk ids, a formulation independent of draco's.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def real_slime() -> bool:
    """slime's own source is importable (not a namesake package)."""
    try:
        return importlib.util.find_spec("slime.utils.types") is not None
    except ModuleNotFoundError:
        return False


def zigzag(values: np.ndarray, total: int, cp_rank: int, cp_size: int) -> np.ndarray:
    """The part of a response row that CP rank ``cp_rank`` holds, by chunk id."""
    resp = len(values)
    if cp_size == 1:
        return values
    chunk = -(-total // (2 * cp_size))
    logit_pos = np.arange(resp) + (total - resp) - 1
    owner = logit_pos // chunk
    first = values[owner == cp_rank]
    second = values[owner == 2 * cp_size - 1 - cp_rank]
    return np.concatenate([first, second])


@contextmanager
def megatron_mpu(cp_rank: int = 0, cp_size: int = 1, last_stage: bool = True) -> Any:
    """``megatron.core.mpu`` as slime's loss code asks it (megatron is GPU-only): the CP
    rank and size, and whether this is the last pipeline stage."""
    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_context_parallel_rank = lambda: cp_rank  # type: ignore[attr-defined]
    mpu.get_context_parallel_world_size = lambda: cp_size  # type: ignore[attr-defined]
    mpu.is_pipeline_last_stage = lambda: last_stage  # type: ignore[attr-defined]
    core = types.ModuleType("megatron.core")
    core.mpu = mpu  # type: ignore[attr-defined]
    meg = types.ModuleType("megatron")
    meg.core = core  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("megatron", "megatron.core", "megatron.core.mpu")}
    sys.modules.update({"megatron": meg, "megatron.core": core, "megatron.core.mpu": mpu})
    try:
        yield mpu
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def make_samples(rng: np.random.Generator, prompts: int, n: int, *, turns: int = 3,
                 vocab: int = 300, start_index: int = 0) -> list[dict[str, Any]]:
    """``prompts`` × ``n`` multi-turn samples in ``Sample.to_dict()`` form, numbered as
    slime's data source numbers them (group_index per prompt, index per sample)."""
    out = []
    index = start_index
    for g in range(prompts):
        prompt = rng.integers(3, vocab, size=int(rng.integers(4, 12))).tolist()
        for _ in range(n):
            mask: list[int] = []
            for t in range(int(rng.integers(1, turns + 1))):
                if t:
                    mask += [0] * int(rng.integers(1, 6))   # tool output
                mask += [1] * int(rng.integers(1, 9))
            resp = rng.integers(3, vocab, size=len(mask)).tolist()
            d = {"group_index": g, "index": index, "rollout_id": None,
                 "prompt": f"task {g}", "tokens": prompt + resp,
                 "response_length": len(resp), "response": "", "label": None,
                 "reward": float(rng.integers(0, 2)), "loss_mask": mask,
                 "remove_sample": False, "status": "completed", "metadata": {}}
            out.append(_as_slime(d))
            index += 1
    return out


def _as_slime(d: dict[str, Any]) -> dict[str, Any]:
    if not real_slime():
        return d
    from slime.utils.types import Sample

    s = Sample(**{k: v for k, v in d.items() if k != "status"})
    s.status = Sample.Status(d["status"])
    out: dict[str, Any] = s.to_dict()
    return out


def save_dump(path: Path, rollout_id: int, samples: list[dict[str, Any]]) -> Path:
    """A ``--save-debug-rollout-data`` file of these samples."""
    if real_slime():
        from slime.observability.rollout_data_utils import save_debug_rollout_data
        from slime.utils.types import Sample

        save_debug_rollout_data(str(path), [Sample.from_dict(s) for s in samples],
                                rollout_id=rollout_id, evaluation=False)
    else:
        import torch

        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout_id, "samples": samples}, path)
    return path


def rank_data(samples: list[dict[str, Any]], partition: list[int], *, cp_rank: int = 0,
              cp_size: int = 1) -> dict[str, Any]:
    """One DP rank's ``rollout_data`` when slime calls the advantage function."""
    import torch

    picked = [samples[j] for j in partition]
    masks = [s["loss_mask"] if s["loss_mask"] is not None else [1] * s["response_length"]
             for s in picked]
    data: dict[str, Any] = {
        "partition": list(partition),
        "tokens": [torch.tensor(s["tokens"], dtype=torch.long) for s in picked],
        "response_lengths": [s["response_length"] for s in picked],
        "total_lengths": [len(s["tokens"]) for s in picked],
        "loss_masks": [torch.tensor([0] * len(m) if s["remove_sample"] else m,
                                    dtype=torch.int) for s, m in zip(picked, masks)],
        "sample_indices": [s["index"] for s in picked],
        "rollout_ids": [s["index"] if s["rollout_id"] is None else s["rollout_id"]
                        for s in picked],
        "rewards": [s["reward"] for s in picked],
    }
    # slime computes the KL before the custom function: CP-local, one entry per sample
    data["kl"] = [torch.zeros(len(zigzag(np.zeros(r), t, cp_rank, cp_size)))
                  for r, t in zip(data["response_lengths"], data["total_lengths"])]
    return data


def as_objects(samples: list[dict[str, Any]]) -> list[Any]:
    """The samples as the RolloutManager holds them (``Sample`` objects, attribute access)."""
    if real_slime():
        from slime.utils.types import Sample

        return [Sample.from_dict(s) for s in samples]
    return [types.SimpleNamespace(**s) for s in samples]
