"""TRL (1.16): a ``GRPOTrainer`` whose advantages are draco's per-token values.

Only ``_generate_and_score_completions`` is overridden: TRL's loss unsqueezes advantages only
when they are 1-D ("to support subclasses that provide advantages with shape (B, T)"), so a
[B, T] tensor flows through every loss type unchanged.

Row identity: a row's rollout id is ``f"{row[id_column]}:{k}"``, ``id_column`` a dataset
column naming the task (or prompt) and k the row's index within its group of
``num_generations``, counted in the all-process order (TRL's sampler keeps a group's rows
contiguous in that order, split across processes by rank). ``rollout_ids`` computes the same
ids for the rollout logger (e.g. inside a reward function, which sees the same rows in the
same order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draco_cli.trainers.loader import AlignmentError, load_token_advantages

__all__ = ["DracoGRPOTrainer", "rollout_ids"]  # noqa: F822 (built lazily, see __getattr__)

Files = str | Path | Sequence[str | Path]


def rollout_ids(inputs: Sequence[dict[str, Any]], *, id_column: str, num_generations: int,
                process_index: int = 0) -> list[str]:
    """Rollout ids of a process's rows, ``inputs`` as TRL passes them (one dict per row)."""
    ids = []
    base = process_index * len(inputs)
    for j, row in enumerate(inputs):
        if id_column not in row:
            raise AlignmentError(f"trainer row {j}: no dataset column {id_column!r} to name the "
                                 "rollout")
        ids.append(f"{row[id_column]}:{(base + j) % num_generations}")
    dup = len(ids) - len(set(ids))
    if dup:
        raise AlignmentError(f"{dup} trainer rows share a rollout id: the batch holds a task "
                             f"twice; make {id_column!r} unique per sampled prompt")
    return ids


def _trainer_class() -> type[Any]:
    from trl import GRPOTrainer

    # TRL ships no types for mypy to follow: GRPOTrainer is Any
    class DracoGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        """``GRPOTrainer`` taking advantages from draco's ``token_advantages.parquet``.

        ``token_advantages``: a path (or list of paths), a path template with ``{step}``
        (formatted with the trainer's global step), or a callable ``step -> path(s)`` (which
        may run draco on the rollouts just logged). With a template or callable the rows claim
        that train step and the file must agree. ``id_column``: the dataset column that names
        the task (see ``rollout_ids``).
        """

        def __init__(self, *args: Any, token_advantages: Files | Callable[[int], Files],
                     id_column: str = "task_id", **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.draco_token_advantages = token_advantages
            self.draco_id_column = id_column

        def _draco_files(self) -> tuple[Files, int | None]:
            step = int(self.state.global_step)
            spec = self.draco_token_advantages
            if callable(spec):
                return spec(step), step
            if isinstance(spec, str) and "{step}" in spec:
                return spec.format(step=step), step
            return spec, None

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            import torch

            out: dict[str, Any] = super()._generate_and_score_completions(inputs)
            ids = rollout_ids(inputs, id_column=self.draco_id_column,
                              num_generations=self.num_generations,
                              process_index=self.accelerator.process_index)
            mask = out["completion_mask"]
            if "tool_mask" in out:  # tool results inside a completion are not the policy's
                mask = mask * out["tool_mask"]
            mask_np = mask.detach().cpu().numpy()
            # With mask_truncated_completions TRL zeroes a truncated row's whole mask: the row
            # carries no loss, so it is marked padding rather than checked.
            padding = (mask_np.sum(axis=1) == 0) if self.mask_truncated_completions else None
            files, step = self._draco_files()
            table = load_token_advantages(files, rollout_ids=ids)
            adv = table.batch(ids, mask_np, train_step=step,
                              response_ids=out["completion_ids"].detach().cpu().numpy(),
                              padding=padding)
            out["advantages"] = torch.as_tensor(adv, device=mask.device, dtype=torch.float32)
            return out

    return DracoGRPOTrainer


def __getattr__(name: str) -> type[Any]:
    # The class is built on first use so that importing this module never imports TRL or torch.
    if name == "DracoGRPOTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
