"""TRL (1.16): a ``GRPOTrainer`` whose advantages are draco's per-token values.

See docs/trainers.md, "TRL (1.16)". Only ``_generate_and_score_completions`` (and
``_calculate_rewards``) is overridden: TRL's loss unsqueezes advantages only when they are 1-D,
so a [B, T] tensor reaches every loss type unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any


from draco_cli.errors import UsageError
from draco_cli.trainers import lazy_class
from draco_cli.trainers.loader import AlignmentError, load_token_advantages
from draco_cli.trainers.trl_rows import completion_rows, group_rollouts

if TYPE_CHECKING:
    from draco_cli.options import RunOptions

__all__ = ["DracoGRPOTrainer", "completion_rows", "group_rollouts",  # noqa: F822 (lazy)
           "rollout_ids"]

Files = str | Path | Sequence[str | Path]


def rollout_ids(inputs: Sequence[dict[str, Any]], *, id_column: str, num_generations: int,
                process_index: int | None = None) -> list[str]:
    """Rollout ids of a process's rows, ``inputs`` as TRL passes them (one dict per row).
    ``process_index``: the training process the rows belong to; None reads it from accelerate
    (``PartialState().process_index``), which is right inside a reward function."""
    if process_index is None:
        from accelerate import PartialState

        process_index = int(PartialState().process_index)
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

    from draco_cli.trainers import trl_step

    # TRL ships no types for mypy to follow: GRPOTrainer is Any
    class DracoGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        """``GRPOTrainer`` whose advantages are draco's per-token values. Arguments: see
        docs/trainers.md, "TRL (1.16)": ``judge`` with ``judge_kwargs``, ``options``,
        ``call_log``, ``deadline`` (None waits), ``fallback``, ``steps_dir``/``keep_steps``; or
        ``token_advantages`` (a path, a list of paths, a ``{step}`` template or a callable
        ``step -> path(s)``; with the last two the rows claim that train step) and
        ``id_column``."""

        def __init__(self, *args: Any, token_advantages: Files | Callable[[int], Files] |
                     None = None, id_column: str = "task_id", judge: str | None = None,
                     judge_kwargs: Mapping[str, Any] | None = None,
                     options: RunOptions | None = None, call_log: str | Path | None = None,
                     deadline: float | None = None, fallback: str = "outcome",
                     steps_dir: str | Path | None = None, keep_steps: int | None = None,
                     **kwargs: Any) -> None:
            if (token_advantages is None) == (judge is None):
                raise UsageError("DracoGRPOTrainer: give judge= (draco scores each step's "
                                 "generations) or token_advantages= (draco's files), one of "
                                 "the two")
            if keep_steps is not None and keep_steps < 1:
                raise UsageError(f"keep_steps {keep_steps!r}: at least 1 step folder (None "
                                 "keeps all)")
            super().__init__(*args, **kwargs)
            self.draco_token_advantages = token_advantages
            self.draco_id_column = id_column
            self.draco: trl_step.InStep | None = None
            if judge is not None:
                self.draco = trl_step.InStep(
                    self, judge, dict(judge_kwargs or {}), options=options,
                    call_log=call_log or Path(self.args.output_dir) / "draco" /
                    "llm_calls.sqlite", deadline=deadline, fallback=fallback,
                    steps_dir=steps_dir, keep_steps=keep_steps)

        def _draco_files(self) -> tuple[Files, int | None]:
            step = int(self.state.global_step)
            spec = self.draco_token_advantages
            assert spec is not None   # the file route
            if callable(spec):
                return spec(step), step
            if isinstance(spec, str) and "{step}" in spec:
                return spec.format(step=step), step
            return spec, None

        def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any,
                               completion_ids_list: Any) -> Any:
            # every process's rewards (TRL gathers them): the outcome of each row of the step
            rewards = super()._calculate_rewards(inputs, prompts, completions,
                                                 completion_ids_list)
            self._draco_rewards = rewards
            return rewards

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = super()._generate_and_score_completions(inputs)
            if self.draco is not None:
                if self.model.training:   # evaluation keeps TRL's own advantages
                    self.draco.score(inputs, out)
                return out
            import torch

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

        def train(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().train(*args, **kwargs)
            finally:
                if self.draco is not None:
                    self.draco.close()

    return DracoGRPOTrainer


def __getattr__(name: str) -> type[Any]:
    # The class is built on first use so that importing this module never imports TRL or torch.
    return lazy_class(globals(), name, {"DracoGRPOTrainer": _trainer_class})
