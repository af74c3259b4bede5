"""OpenRLHF (0.11): draco's token advantages in place of the experience maker's estimator.

OpenRLHF has no switch to skip its own estimator, so ``DracoExperienceMaker`` overrides
``RemoteExperienceMaker.compute_advantages_and_returns`` (use it inside the trainer's Ray actor,
where the experience maker is built). Its ``action_mask`` covers the whole sequence minus its
first token, prompt included: response token t of row b sits at column ``P_b - 1 + t``, P_b the
prompt length, i.e. the column of the row's first action token. ``place`` does that shift.

Row identity travels with the row through OpenRLHF's reordering (``split_rollout_samples``,
dynamic batching): either an id sent by the agent through ``extra_logs`` (a number, stored in
``experience.info[id_key]``; the rollout id is its decimal string) or ``experience.index``
mapped by ``ids_from_index``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.trainers.loader import AlignmentError, TokenAdvantageTable, load_token_advantages

__all__ = ["ID_KEY", "STEP_KEY", "DracoExperienceMaker", "experience_rollout_ids", "place"]  # noqa: F822

ID_KEY = "draco_rollout_id"
STEP_KEY = "draco_train_step"


def experience_rollout_ids(experience: Any, *, id_key: str = ID_KEY,
                           ids_from_index: Callable[[int], str] | None = None) -> list[str]:
    """The rollout id of each row of one Experience (see the module docstring)."""
    info = experience.info or {}
    if id_key in info:
        vals = info[id_key]
        vals = vals.tolist() if hasattr(vals, "tolist") else list(vals)
        return [str(int(v)) for v in vals]
    if ids_from_index is None or experience.index is None:
        raise AlignmentError(f"experience rows carry no {id_key!r} in info (send it through the "
                             "agent's extra_logs) and no ids_from_index was given")
    return [ids_from_index(int(i)) for i in experience.index]


def place(table: TokenAdvantageTable, ids: Sequence[str], action_mask: np.ndarray,
          sequences: np.ndarray | None = None, *, train_step: Any = None) -> np.ndarray:
    """float32 [B, A] advantages laid on OpenRLHF's action columns, checked row by row.

    Row b's response starts at action column c_b (its first 1), so response token t goes to
    column c_b + t and its token id is ``sequences[b, c_b + 1 + t]``."""
    mask = np.asarray(action_mask).astype(np.int64)
    B, A = mask.shape
    first = np.where(mask.any(axis=1), mask.argmax(axis=1), 0)
    shifted = np.zeros_like(mask)
    resp_ids = None if sequences is None else np.zeros((B, A), dtype=np.int64)
    for b in range(B):
        c = int(first[b])
        shifted[b, : A - c] = mask[b, c:]
        if resp_ids is not None and sequences is not None:
            resp_ids[b, : A - c] = sequences[b, c + 1: c + 1 + A - c]
    adv = table.batch(ids, shifted, response_ids=resp_ids, train_step=train_step)
    out = np.zeros((B, A), dtype=np.float32)
    for b in range(B):
        c = int(first[b])
        out[b, c:] = adv[b, : A - c]
    return out


def _maker_class() -> type[Any]:
    import torch
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    # OpenRLHF ships no types: its classes are Any to mypy
    class DracoExperienceMaker(RemoteExperienceMaker):  # type: ignore[misc]
        """``RemoteExperienceMaker`` whose advantages (and returns) are draco's.

        Extra keyword arguments: ``token_advantages`` (path(s) of token_advantages.parquet, or
        a callable returning them for the rows' ids), ``id_key`` / ``ids_from_index`` (row
        identity, see ``experience_rollout_ids``)."""

        def __init__(self, *args: Any, token_advantages: Any, id_key: str = ID_KEY,
                     ids_from_index: Callable[[int], str] | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.draco_token_advantages = token_advantages
            self.draco_id_key = id_key
            self.draco_ids_from_index = ids_from_index

        def compute_advantages_and_returns(self, experiences: list[Any]) -> list[Any]:
            rows = [experience_rollout_ids(e, id_key=self.draco_id_key,
                                           ids_from_index=self.draco_ids_from_index)
                    for e in experiences]
            spec = self.draco_token_advantages
            files = spec([i for r in rows for i in r]) if callable(spec) else spec
            table = load_token_advantages(
                files if isinstance(files, (str, Path)) else list(files),
                rollout_ids=[i for r in rows for i in r])
            for e, ids in zip(experiences, rows):
                step = e.info.get(STEP_KEY) if e.info else None
                step = None if step is None else [int(s) for s in step.tolist()]
                adv = place(table, ids, e.action_mask.cpu().numpy(), e.sequences.cpu().numpy(),
                            train_step=step)
                e.advantages = torch.as_tensor(adv, device=e.action_mask.device)
                e.returns = e.advantages.clone()
                e.info["return"] = e.advantages.sum(dim=-1)
                e.kl = None
            return experiences

    return DracoExperienceMaker


def __getattr__(name: str) -> type[Any]:
    # Built on first use: importing this module never imports OpenRLHF, Ray or torch.
    if name == "DracoExperienceMaker":
        cls = _maker_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
