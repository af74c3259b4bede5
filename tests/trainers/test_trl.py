"""draco_cli.trainers.trl: one real GRPOTrainer.train() step of TRL 1.16 on CPU.

A tiny randomly initialised Qwen2 model built from a config and a locally built ChatML
tokenizer; a reward function logs each completion (its rollout id, token ids, train step) the
way a rollout logger would; at advantage time draco runs on those logs (ingest with the
trainer's tokens, verdicts, credit compute) and the subclass feeds the values to TRL's loss.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainers.chatml import chatml_tokenizer
from tests.trainers.draco_files import Rollout, draco_token_file

pytestmark = pytest.mark.trainers
torch = pytest.importorskip("torch", reason="needs the trainers extra (torch)")
trl = pytest.importorskip("trl", reason="needs the trainers extra (TRL 1.16.0)")

G = 2  # num_generations


def _model(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    # A quarter of the vocabulary ends a completion, so completions differ in length and the
    # group-normalised advantages do not cancel in the loss (TRL reads these ids too).
    model.generation_config.eos_token_id = [tok.eos_token_id, *range(100, 180)]
    return model


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_one_train_step_loss_is_minus_sum_of_draco_advantages(tmp_path, mask_truncated):
    from datasets import Dataset
    from trl import GRPOConfig

    from draco_cli.trainers.trl import DracoGRPOTrainer, rollout_ids

    tok = chatml_tokenizer()
    logged: list[Rollout] = []
    steps_logged: set[int] = set()

    def log_rollouts(prompts, completions, completion_ids, task_id, trainer_state, **kw):
        # The rollout logger: the same ids the trainer subclass computes for these rows.
        ids = rollout_ids([{"task_id": t} for t in task_id], id_column="task_id",
                          num_generations=G)
        for rid, t, c in zip(ids, task_id, completion_ids):
            logged.append(Rollout(rid, t, list(c), [1] * len(c), ["completion"]))
        steps_logged.add(int(trainer_state.global_step))
        return [0.0] * len(prompts)

    def run_draco(step):
        assert steps_logged == {step}
        return draco_token_file(tmp_path, logged, train_step=step,
                                rng=np.random.default_rng(step), name=f"step-{step}")

    data = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"book flight {i}"}] for i in range(2)],
        "task_id": ["t0", "t1"],
    })
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                      num_generations=G, max_completion_length=8, max_steps=1,
                      gradient_accumulation_steps=1, steps_per_generation=1, loss_type="dapo",
                      beta=0.0, learning_rate=1e-3, use_cpu=True, report_to=[],
                      logging_steps=1, save_strategy="no", seed=0, bf16=False,
                      mask_truncated_completions=mask_truncated)
    seen = {}

    class Recording(DracoGRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            seen.update(inputs=inputs, loss=float(loss.detach()))
            return loss

    trainer = Recording(model=_model(tok), reward_funcs=[log_rollouts], args=args,
                        train_dataset=data, processing_class=tok,
                        token_advantages=run_draco, id_column="task_id")
    trainer.train()

    inputs = seen["inputs"]
    A = inputs["advantages"].numpy()
    mask = inputs["completion_mask"].numpy()
    assert A.shape == mask.shape and A.ndim == 2  # per-token, (B, T)
    # Every row holds exactly its own rollout's values (found by id and checked by fingerprint).
    from draco_cli.trainers.loader import load_token_advantages

    table = load_token_advantages(tmp_path / "step-0" / "credit" / "token_advantages.parquet")
    comp = inputs["completion_ids"].numpy()
    # TRL shuffles rows after generation, so rows are matched to logged rollouts by their
    # tokens; rollouts with identical tokens must receive their values as a multiset.
    by_tokens: dict[tuple, list[str]] = {}
    for r in logged:
        by_tokens.setdefault(tuple(r.response_ids), []).append(r.rollout_id)
    got: dict[tuple, list] = {}
    live = mask.sum(axis=1) > 0
    for b in np.flatnonzero(live):
        key = tuple(comp[b, : int(mask[b].sum())])
        got.setdefault(key, []).append(A[b, : len(key)].tolist())
    for key, rows in got.items():
        assert sorted(rows) == sorted(table.get(r).tolist() for r in by_tokens[key])
    # Truncated rows under mask_truncated_completions: all-zero mask, marked padding, zeros.
    assert not A[~live].any()
    if mask_truncated:
        assert (~live).any(), "no completion was truncated: the case is not exercised"
    else:
        assert live.all() and set(got) == set(by_tokens)
    assert np.any(A != 0) and len(set(mask[live].sum(axis=1).tolist())) > 1
    # dapo, beta 0, first step on-policy (ratio 1): loss = -sum(A * mask) / num_items.
    expected = -float((A * mask).sum()) / float(inputs["num_items_in_batch"])
    print(f"\nTRL loss {seen['loss']:.6f}, -sum(A*mask)/num_items {expected:.6f}")
    assert abs(expected) > 1e-3
    assert seen["loss"] == pytest.approx(expected, rel=1e-5)
