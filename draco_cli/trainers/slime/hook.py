"""slime's ``--custom-advantage-function-path``: draco's token advantages as slime's per-sample
``advantages`` and ``returns``.

See docs/trainers.md, "slime" (read at 624b824a). ``rollout_data`` holds this data-parallel
rank's samples, every per-token tensor in it (``kl`` included) CP-local: ``layout.cp_local``
cuts draco's rows the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.errors import UsageError
from draco_cli.trainers.loader import AdvantageFiles, AlignmentError, TokenAdvantageTable
from draco_cli.trainers.slime.layout import cp_local

SOURCE_KEY = "draco_token_advantages"
# the step folders' files, read once each, held while batches need them
_files_read = AdvantageFiles()


def _np(x: Any, dtype: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False).reshape(-1)


def sample_ids(rollout_data: dict[str, Any]) -> list[str]:
    """draco's rollout id of each sample: ``Sample.index`` as a decimal string."""
    if "sample_indices" not in rollout_data:
        raise AlignmentError("rollout_data has no 'sample_indices': slime's sample index is the "
                             "id draco finds each sample's advantages by")
    vals = rollout_data["sample_indices"]
    vals = vals.tolist() if hasattr(vals, "tolist") else list(vals)
    if any(v is None for v in vals):
        raise AlignmentError("rollout_data['sample_indices'] holds None: a sample without an "
                             "index (Sample.index) cannot be matched to its advantages")
    ids = [str(int(v)) for v in vals]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise AlignmentError(f"sample index {dup} appears twice in this batch: draco keys rows "
                             "by Sample.index, which must be unique per training sample")
    return ids


def resolve_files(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """token_advantages.parquet files of ``source``: files, a run folder (its
    credit/token_advantages.parquet), or a folder of ``step-*`` run folders (every step's)."""
    items = [source] if isinstance(source, (str, Path)) else list(source)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_file():
            out.append(p)
        elif (p / "credit" / "token_advantages.parquet").is_file():
            out.append(p / "credit" / "token_advantages.parquet")
        elif p.is_dir() and (steps := sorted(p.glob("step-*/credit/token_advantages.parquet"))):
            out.extend(steps)
        else:
            raise UsageError(f"{SOURCE_KEY}: {p} is neither a token_advantages.parquet, a run "
                             "folder, nor a folder of step-* run folders")
    return out


def dense_advantages(rollout_data: dict[str, Any], table: TokenAdvantageTable, *,
                     cp_rank: int = 0, cp_size: int = 1) -> list[np.ndarray]:
    """float32 advantages of each sample over its response, cut to this CP rank's part."""
    ids = sample_ids(rollout_data)
    n = len(ids)
    cols = {k: rollout_data.get(k) for k in ("tokens", "response_lengths", "total_lengths",
                                              "loss_masks")}
    for k, v in cols.items():
        if v is None or len(v) != n:
            raise AlignmentError(f"rollout_data[{k!r}] has {'no' if v is None else len(v)} "
                                 f"entries for {n} samples")
    tokens = [_np(t, np.int64) for t in cols["tokens"]]  # type: ignore[union-attr]
    masks = [_np(m, np.int64) for m in cols["loss_masks"]]  # type: ignore[union-attr]
    resp = [int(x) for x in cols["response_lengths"]]  # type: ignore[union-attr]
    total = [int(x) for x in cols["total_lengths"]]  # type: ignore[union-attr]
    live = []
    for i in range(n):
        where = f"sample {ids[i]} (batch row {i})"
        if len(tokens[i]) != total[i] or not 0 < resp[i] <= total[i]:
            raise AlignmentError(f"{where}: {len(tokens[i])} tokens, total_length {total[i]}, "
                                 f"response_length {resp[i]}: not one sequence")
        if len(masks[i]) != resp[i]:
            raise AlignmentError(f"{where}: loss mask of {len(masks[i])} tokens for a "
                                 f"response of {resp[i]}")
        if not masks[i].any():
            continue  # removed sample: trains on nothing
        if ids[i] not in table:
            raise AlignmentError(f"{where}: no advantages in {table.source} (never a silent "
                                 "zero: score it, or drop the sample)")
        if table.length(ids[i]) != resp[i]:
            raise AlignmentError(f"{where}: the file's response has {table.length(ids[i])} "
                                 f"tokens, slime's {resp[i]}: not the same response")
        live.append(i)
    rows = [np.zeros(r, dtype=np.float32) for r in resp]
    if live:
        width = max(resp[i] for i in live)
        mask = np.zeros((len(live), width), dtype=np.int64)
        rids = np.zeros((len(live), width), dtype=np.int64)
        for b, i in enumerate(live):
            mask[b, : resp[i]] = masks[i]
            rids[b, : resp[i]] = tokens[i][total[i] - resp[i]:]
        got = table.batch([ids[i] for i in live], mask, response_ids=rids)
        for b, i in enumerate(live):
            rows[i] = got[b, : resp[i]]
    out = [cp_local(rows[i], total[i], cp_rank, cp_size) for i in range(n)]
    kl = rollout_data.get("kl")
    if kl is not None:
        for i, k in enumerate(kl):
            if len(k) != len(out[i]):
                raise AlignmentError(
                    f"sample {ids[i]} (batch row {i}): slime's KL has {len(k)} tokens on this "
                    f"rank, draco's CP cut {len(out[i])} (cp_rank {cp_rank} of {cp_size}): the "
                    "context-parallel layout is not slime's zigzag")
    return out


def _layout() -> tuple[bool, int, int]:
    """(last pipeline stage, CP rank, CP size) of this Megatron process."""
    try:
        from megatron.core import mpu  # type: ignore[import-not-found]
    except ImportError:
        raise UsageError("draco_cli.trainers.slime.advantages runs inside slime's Megatron "
                         "actor (megatron.core is not importable here)") from None
    return (bool(mpu.is_pipeline_last_stage()), int(mpu.get_context_parallel_rank()),
            int(mpu.get_context_parallel_world_size()))


def advantages(args: Any, rollout_data: dict[str, Any]) -> None:
    """slime's custom advantage function: ``--custom-advantage-function-path
    draco_cli.trainers.slime.advantages`` with ``draco_token_advantages: PATH`` in the YAML of
    ``--custom-config-path`` (a token_advantages.parquet, a run folder, or a folder of step-*
    run folders, e.g. the ``draco_step_dir`` that ``score_rewards`` writes)."""
    import torch

    source = getattr(args, SOURCE_KEY, None)
    if not source:
        raise UsageError(f"set {SOURCE_KEY}: PATH in the --custom-config-path YAML (the "
                         "token_advantages.parquet, run folder or step folders to read)")
    if getattr(args, "normalize_advantages", False) and not getattr(
            args, "draco_allow_normalize", False):
        raise UsageError("--normalize-advantages would whiten draco's advantages after this "
                         "function; drop it, or set draco_allow_normalize: true to train on "
                         "whitened values")
    last, cp_rank, cp_size = _layout()
    if not last:
        # as slime's own estimators: earlier pipeline stages hold no per-token outputs
        return
    ids = sample_ids(rollout_data)
    table = _files_read.load([str(p) for p in resolve_files(source)], ids)
    rows = dense_advantages(rollout_data, table, cp_rank=cp_rank, cp_size=cp_size)
    kl = rollout_data.get("kl")
    masks = rollout_data["loss_masks"]
    device = getattr(kl[0] if kl else (masks[0] if len(masks) else None), "device", "cpu")
    adv = [torch.as_tensor(r, dtype=torch.float32, device=device) for r in rows]
    rollout_data["advantages"] = adv
    # GRPO-style: slime's own grpo path sets returns equal to advantages
    rollout_data["returns"] = [a.clone() for a in adv]

