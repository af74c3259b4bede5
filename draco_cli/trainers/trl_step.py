"""TRL's in-step scoring (``DracoGRPOTrainer(judge=...)``): every process's rows gathered to the
main process, scored by one ``BlockingStepScorer``, each process's own values sent back as the
[B, T] ``advantages``. The rules (outcome, truncated rows, evaluation, metrics):
docs/trainers.md, "Scoring inside the step"."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from draco_cli.trainers.trl_rows import completion_rows, group_rollouts

if TYPE_CHECKING:
    from draco_cli.inloop import BlockingStepScorer
    from draco_cli.options import RunOptions

T = TypeVar("T")


class InStep:
    """The trainer's draco: opens the scorer on the main process, scores each step."""

    def __init__(self, trainer: Any, model: str, llm: dict[str, Any], *,
                 options: RunOptions | None, call_log: str | Path, deadline: float | None,
                 fallback: str, steps_dir: str | Path | None, keep_steps: int | None) -> None:
        self.trainer = trainer
        self.model, self.llm = model, llm
        self.settings: dict[str, Any] = {"call_log": call_log, "options": options,
                                         "deadline": deadline, "fallback": fallback}
        self.steps_dir, self.keep_steps = steps_dir, keep_steps
        self.scorer: BlockingStepScorer | None = None
        tok = trainer._tokenizer
        self.decode: Callable[[list[int]], str] = \
            lambda ids: str(tok.decode(ids, skip_special_tokens=True))
        self.on_main(self.open)   # bad settings fail on every process, at construction

    def open(self) -> None:
        if self.scorer is None:
            from draco_cli.inloop import BlockingStepScorer

            self.scorer = BlockingStepScorer(self.model, group_size=self.trainer.num_generations,
                                             decode=self.decode, **self.settings, **self.llm)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None

    def on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the main process, its value (or its error) on every process."""
        acc = self.trainer.accelerator
        box: list[Any] = [None]
        error: BaseException | None = None
        if acc.is_main_process:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:   # re-raised below, on every process
                error = exc
                try:
                    pickle.dumps(exc)
                    box[0] = ("error", exc)
                except Exception:
                    box[0] = ("error", RuntimeError(f"draco on the main process: {exc}"))
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(box, from_process=0)
        status, value = box[0]
        if status == "error":
            raise error if error is not None else value
        return value  # type: ignore[no-any-return]

    def outcomes(self, n: int) -> list[float | None]:
        """Each row's outcome, all processes' rows in order (TRL gathers the rewards)."""
        t = self.trainer
        rewards = getattr(t, "_draco_rewards", None)
        if not len(t.reward_funcs) or rewards is None:
            return [None] * n
        r = rewards.detach().float().cpu()
        w = t.reward_weights.to(r.dtype)
        total = (r * w).nansum(dim=1).numpy()
        none = r.isnan().all(dim=1).numpy()
        if len(total) != n:
            raise RuntimeError(f"draco: {len(total)} rewards for {n} rows of the step")
        return [None if x else float(v) for v, x in zip(total, none)]

    def score(self, inputs: list[dict[str, Any]], out: dict[str, Any]) -> None:
        """Score the step's rows and set ``out["advantages"]`` to this process's [B, T]."""
        import torch

        t = self.trainer
        acc = t.accelerator
        comp = out["completion_ids"].detach().cpu().numpy()
        tool = out.get("tool_mask")
        rows = completion_rows(comp, out["completion_mask"].detach().cpu().numpy(),
                               None if tool is None else tool.detach().cpu().numpy(),
                               int(t._tokenizer.pad_token_id),
                               bool(t.mask_truncated_completions))
        pids = out["prompt_ids"].detach().cpu().numpy()
        pmask = out["prompt_mask"].detach().cpu().numpy()
        col = t.draco_id_column
        local = [{"ids": ids.tolist(), "mask": m.tolist(), "truncated": cut,
                  "prompt": self.decode(pids[b][pmask[b] == 1].tolist()),
                  "task_id": str(inputs[b][col]) if col in inputs[b] else None,
                  "proc": int(acc.process_index)}
                 for b, (ids, m, cut) in enumerate(rows)]
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            everyone = gather_object(local)
        else:
            everyone = local
        for r, o in zip(everyone, self.outcomes(len(everyone))):
            r["outcome"] = o
        step = int(t.state.global_step)
        values, metrics = self.on_main(lambda: self._score_all(everyone, step))
        start = sum(1 for r in everyone if r["proc"] < acc.process_index)
        adv = np.zeros(comp.shape, dtype=np.float32)
        for b, r in enumerate(local):
            if not r["truncated"]:   # a truncated row's loss is masked: zeros
                v = values[start + b]
                adv[b, : len(v)] = v
        out["advantages"] = torch.as_tensor(adv, device=out["completion_mask"].device)
        for key, value in metrics.items():
            t._metrics["train"][key].append(value)

    def _score_all(self, rows: list[Mapping[str, Any]], step: int
                   ) -> tuple[list[np.ndarray], dict[str, float]]:
        self.open()
        assert self.scorer is not None
        rollouts = group_rollouts(rows, group_size=self.trainer.num_generations,
                                  train_step=step)
        result = self.scorer.score_step(rollouts, step)
        if self.steps_dir is not None:
            from draco_cli.inloop import write_step

            write_step(result, self.steps_dir, keep=self.keep_steps)
        metrics = dict(result.metrics)
        metrics["draco/truncated_rollouts"] = float(sum(bool(r["truncated"]) for r in rows))
        return [result.rows[r.rollout_id].values for r in rollouts], metrics
