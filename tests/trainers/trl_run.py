"""A real TRL 1.16 GRPO run with draco scoring inside the step: ``build`` makes the trainer
(tests/trainers/test_trl.py runs it in-process), and as a script it runs alone (the restart
test) or under torchrun with 2 processes (gloo on CPU). Every process records what TRL's loss
received at each call (saved as rank{r}.pt by the script); the main process saves the
trainer's log history. ``--kill-after N`` SIGKILLs the run after step N.

    python tests/trainers/trl_run.py --base-url URL --out DIR [--steps 2] [--kill-after 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":   # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

G = 2  # num_generations


def outcome(completion_ids, **kw):
    """The environment's reward: 1 for a completion of even length."""
    return [float(len(c) % 2 == 0) for c in completion_ids]


def build(out: Path, base_url: str, *, steps: int = 2, batch: int = 3,
          kill_after: int | None = None, callbacks: list | None = None, **draco: Any):
    """(trainer, records): records get one dict per loss call (the inputs TRL's loss read)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from draco_cli.trainers.trl import DracoGRPOTrainer
    from tests.trainers.chatml import chatml_tokenizer
    from tests.trainers.test_trl import _model

    tok = chatml_tokenizer()
    data = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"book flight #{i} now"}] for i in range(16)],
        "task_id": [f"t{i}" for i in range(16)],
    })
    args = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=batch,
                      num_generations=G, max_completion_length=8, max_steps=steps,
                      loss_type="dapo", beta=0.0, learning_rate=1e-3, use_cpu=True,
                      report_to=[], logging_steps=1, save_strategy="no", seed=0, bf16=False,
                      mask_truncated_completions=True)
    records: list[dict[str, Any]] = []

    class Recording(DracoGRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            rec = {k: inputs[k].detach().cpu().clone() for k in
                   ("completion_ids", "completion_mask", "advantages", "num_items_in_batch")}
            records.append(rec | {"loss": float(loss.detach()),
                                  "step": int(self.state.global_step),
                                  "rank": int(self.accelerator.process_index)})
            return loss

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if kill_after is not None and state.global_step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

    draco.setdefault("call_log", out / "calls.sqlite")
    draco.setdefault("steps_dir", out / "steps")
    trainer = Recording(model=_model(tok), reward_funcs=[outcome], args=args,
                        train_dataset=data, processing_class=tok,
                        callbacks=[Kill(), *(callbacks or [])], judge="openai/m",
                        judge_kwargs={"base_url": base_url}, **draco)
    return trainer, records


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps-dir", type=Path)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=3, help="per-device batch size")
    p.add_argument("--kill-after", type=int)
    a = p.parse_args()
    import torch

    trainer, records = build(a.out, a.base_url, steps=a.steps, batch=a.batch,
                             kill_after=a.kill_after,
                             steps_dir=a.steps_dir or a.out / "steps")
    trainer.train()
    torch.save(records, a.out / f"rank{trainer.accelerator.process_index}.pt")
    if trainer.accelerator.is_main_process:
        (a.out / "log_history.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main()
