"""draco_cli.trainers.trl: one real GRPOTrainer.train() step of TRL 1.16 on CPU.

A tiny randomly initialised Qwen2 model built from a config and a locally built ChatML
tokenizer; a reward function logs each completion (its rollout id, token ids, train step) the
way a rollout logger would; at advantage time draco runs on those logs (ingest with the
trainer's tokens, verdicts, credit compute) and the subclass feeds the values to TRL's loss.
"""

from __future__ import annotations

import re

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


# -- scoring inside the step: DracoGRPOTrainer(judge=...) ----------------------------------------
#
# tests/trainers/trl_run.py builds the run (a tiny random Qwen2, G = 2, a reward function as
# the outcome, mask_truncated_completions on); the judge is the project's protocol server with
# scripted answers, started here. The audit folders draco writes each step (the scored rows:
# rollout id, fingerprint of the token ids it scored, values) are what each trainer row is
# checked against: found by the fingerprint of its own tokens, each audited rollout given to
# exactly one row.

KEY = "sk-test-api-0000000000000"


@pytest.fixture
def judge(monkeypatch):
    from tests.llm_server import FakeLLMServer
    from tests.test_rubric_judge import scripted

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def _audit(folder):
    import polars as pl

    from draco_cli.trainers.loader import load_token_advantages

    path = folder / "credit" / "token_advantages.parquet"
    meta = pl.read_parquet(path, columns=["rollout_id", "response_fingerprint", "train_step"])
    table = load_token_advantages(path)
    return {rid: (fp, table.get(rid)) for rid, fp in
            zip(meta["rollout_id"], meta["response_fingerprint"])}


def _check_rows(records, audits, *, per_device, num_processes):
    """Every row of every loss call holds its own rollout's values; the loss is
    -sum(A*mask)/num_items (dapo, beta 0, on-policy). Returns counts for the caller."""
    from draco_cli.trainers.loader import fingerprint
    from tests.trainers.trl_run import G

    pad = chatml_tokenizer().pad_token_id
    given: dict[int, set[str]] = {}
    n = {"live": 0, "truncated": 0, "nonzero": 0, "loss_nonzero": 0}
    for rec in records:
        step, rank = rec["step"], rec["rank"]
        A, mask = rec["advantages"].numpy(), rec["completion_mask"].numpy()
        comp = rec["completion_ids"].numpy()
        assert A.shape == mask.shape and A.ndim == 2   # per-token, (B, T)
        pool = {rid: v for rid, v in audits[step].items() if rid not in given.get(step, ())}
        for b in range(len(A)):
            cut = not mask[b].any()
            length = int(np.flatnonzero(comp[b] != pad)[-1]) + 1 if cut else int(mask[b].sum())
            fp = fingerprint(comp[b, :length])
            match = [rid for rid, (f, v) in pool.items() if f == fp and (
                cut or np.array_equal(A[b, :length], v))]
            assert match, f"step {step} rank {rank} row {b}: no audited rollout has its values"
            rid = match[0]
            del pool[rid]
            given.setdefault(step, set()).add(rid)
            # the row was generated on this process: its index in the all-process order
            g, k = rid.removeprefix(f"step{step}-g").split("-")
            assert (int(g) * G + int(k)) // per_device == rank
            assert not A[b, length:].any()
            if cut:   # truncated: scored in its group, zeros delivered (its loss is masked)
                assert not A[b].any()
            n["truncated" if cut else "live"] += 1
            n["nonzero"] += bool(A[b].any())
        expected = -float((A * mask).sum()) * num_processes / float(rec["num_items_in_batch"])
        assert rec["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
        n["loss_nonzero"] += abs(expected) > 1e-3
    for step, audit in audits.items():   # every scored rollout reached exactly one row
        assert given[step] == set(audit), f"step {step}: rows without a trainer row"
    return n


def test_train_scores_each_step_with_the_judge(judge, tmp_path):
    from transformers import TrainerCallback

    from tests.trainers.trl_run import build

    audits, hits_at_step_end = {}, []

    class Watch(TrainerCallback):   # the audit folder of the step just trained, read now
        def on_step_end(self, args, state, control, **kw):
            hits_at_step_end.append(len(judge.bodies))
            audits[state.global_step - 1] = _audit(
                tmp_path / "steps" / f"step-{state.global_step - 1:06d}")

    trainer, records = build(tmp_path, judge.url + "/v1", steps=2, batch=4, keep_steps=1,
                             callbacks=[Watch()])
    trainer.train()
    assert [r["step"] for r in records] == [0, 1]
    n = _check_rows(records, audits, per_device=4, num_processes=1)
    print(f"\nTRL in-step: {n}, judge requests after each step {hits_at_step_end}")
    assert n["truncated"] and n["live"] and n["nonzero"] and n["loss_nonzero"]
    # the judge answered during the run, for each step
    assert 0 < hits_at_step_end[0] < hits_at_step_end[1]
    # the step's metrics reached TRL's log, each step
    logged = [h for h in trainer.state.log_history if "draco/groups" in h]
    assert [h["draco/groups"] for h in logged] == [2.0, 2.0]
    assert [h["draco/rollouts"] for h in logged] == [4.0, 4.0]
    assert sum(h["draco/judge_calls"] for h in logged) == len(judge.bodies)
    assert sum(h["draco/truncated_rollouts"] for h in logged) == n["truncated"]
    # keep_steps=1: the audit folders rotate
    assert [p.name for p in (tmp_path / "steps").iterdir()] == ["step-000001"]


def test_a_missed_deadline_falls_back_and_is_logged(monkeypatch, tmp_path):
    from tests.llm_server import FakeLLMServer
    from tests.test_rubric_judge import scripted
    from tests.trainers.trl_run import build, outcome

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    slow = FakeLLMServer(answer=scripted, latency=5.0).start()
    try:
        trainer, records = build(tmp_path, slow.url + "/v1", steps=1, batch=4, deadline=0.5,
                                 fallback="outcome")
        trainer.train()
    finally:
        slow.stop()
    logged = next(h for h in trainer.state.log_history if "draco/groups" in h)
    assert logged["draco/fallback_groups"] == 2.0 and logged["draco/fallback_rollouts"] == 4.0
    assert logged["draco/judge_calls"] == 0.0
    # outcome GRPO on every policy token: positive for an even-length completion (outcome 1)
    A, mask = records[0]["advantages"].numpy(), records[0]["completion_mask"].numpy()
    for b in np.flatnonzero(mask.any(axis=1)):
        L = int(mask[b].sum())
        row = A[b, :L]
        assert np.all(row == row[0])
        won = outcome([[0] * L])[0]
        assert row[0] >= 0 if won else row[0] <= 0
    assert np.any(A != 0)


def _script(out, url, *extra, procs=1):
    import os
    import socket
    import subprocess
    import sys

    from tests.trainers.test_docs import REPO

    with socket.socket() as sock:   # a free port for torchrun's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launch = [sys.executable, "tests/trainers/trl_run.py"] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
        "--master_addr=127.0.0.1", f"--master_port={port}", "tests/trainers/trl_run.py"]
    env = dict(os.environ, OPENAI_API_KEY=KEY, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([*launch, "--base-url", url + "/v1", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_two_processes_score_each_group_once(judge, tmp_path):
    import json

    proc = _script(tmp_path, judge.url, "--batch", "3", procs=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [r for rank in (0, 1) for r in torch.load(tmp_path / f"rank{rank}.pt")]
    audits = {s: _audit(tmp_path / "steps" / f"step-{s:06d}") for s in (0, 1)}
    # 6 rows a step, 3 a process: group 1 has a row on each process
    n = _check_rows(records, audits, per_device=3, num_processes=2)
    assert n["live"] + n["truncated"] == 12 and n["nonzero"] and n["loss_nonzero"]
    # each group's requests went to the server once: grader requests = its G rollouts, and
    # every group (the one across processes too) asked the same number of rubric requests
    per_group: dict[str, list[int]] = {}
    for body in judge.bodies:
        text = json.dumps(body)
        task = re.findall(r"book flight #\d+ now", text)
        assert len(set(task)) == 1
        grader = "strict grader" in " ".join(str(m["content"]) for m in body["messages"])
        per_group.setdefault(task[0], [0, 0])[grader] += 1
    assert len(per_group) == 6   # 2 steps x 3 groups
    assert {tuple(c) for c in per_group.values()} == {(next(iter(per_group.values()))[0], 2)}
    history = json.loads((tmp_path / "log_history.json").read_text())
    logged = [h for h in history if "draco/groups" in h]
    assert [h["draco/groups"] for h in logged] == [3.0, 3.0]
    assert sum(h["draco/judge_calls"] for h in logged) == len(judge.bodies)
    # one call log (the main process's), each request in it once
    import sqlite3

    con = sqlite3.connect(tmp_path / "calls.sqlite")
    try:
        assert con.execute("select count(*) from calls").fetchone()[0] == len(judge.bodies)
    finally:
        con.close()


def test_killed_and_restarted_pays_no_judge_call_twice(judge, tmp_path):
    import json

    from tests.trainers.trl_run import build

    first = _script(tmp_path, judge.url, "--batch", "4", "--kill-after", "1",
                    "--steps-dir", str(tmp_path / "steps-a"))
    assert first.returncode == -9, first.stderr[-3000:]   # SIGKILL after step 1
    assert not (tmp_path / "rank0.pt").exists()
    assert [p.name for p in (tmp_path / "steps-a").iterdir()] == ["step-000000"]
    before = {json.dumps(b, sort_keys=True) for b in judge.bodies}
    n_before = len(judge.bodies)
    # restarted with the same seed and call log (here, in this process: one start-up less;
    # one thread, as the script ran, so that the same completions are sampled)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer, _ = build(tmp_path, judge.url + "/v1", steps=2, batch=4,
                           steps_dir=tmp_path / "steps-b")
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    again = [json.dumps(b, sort_keys=True) for b in judge.bodies[n_before:]]
    assert n_before > 0 and again   # step 2 was new
    assert not before.intersection(again)   # no answered request reached the server again

    def metrics(run, step):
        return json.loads((tmp_path / run / f"step-{step:06d}" / "metrics.json").read_text()
                          )["metrics"]

    a0, b0, b1 = metrics("steps-a", 0), metrics("steps-b", 0), metrics("steps-b", 1)
    assert a0["draco/judge_calls"] > 0 and b0["draco/judge_calls"] == 0
    assert b0["draco/cached_calls"] == a0["draco/judge_calls"]
    assert b1["draco/judge_calls"] == len(again)


def test_rows_from_trls_batch_tool_mask_and_truncation():
    from draco_cli.trainers.trl import completion_rows, group_rollouts

    pad = 0
    ids = np.array([[5, 6, 7, 8, 9], [5, 6, 0, 0, 0], [4, 4, 4, 4, 4]])
    cmask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])  # row 2 truncated
    tool = np.array([[1, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    rows = completion_rows(ids, cmask, tool, pad, masked_truncated=True)
    assert [r[0].tolist() for r in rows] == [[5, 6, 7, 8, 9], [5, 6], [4, 4, 4, 4, 4]]
    assert [r[1].tolist() for r in rows] == [[1, 0, 0, 1, 1], [1, 1], [1, 1, 1, 1, 1]]
    assert [r[2] for r in rows] == [False, False, True]
    # without mask_truncated_completions an all-zero row is not guessed at: the core refuses it
    from draco_cli.errors import InputError
    from draco_cli.inloop import trainer_rows

    rows = completion_rows(ids, cmask, tool, pad, masked_truncated=False)
    batch = [{"ids": i, "mask": m, "prompt": "p", "outcome": None, "task_id": None}
             for i, m, _ in rows] + [{"ids": [1], "mask": [1], "prompt": "p", "outcome": None,
                                      "task_id": None}]
    rollouts = group_rollouts(batch, group_size=2, train_step=3)
    assert [r.rollout_id for r in rollouts] == ["step3-g0-0", "step3-g0-1", "step3-g1-0",
                                                "step3-g1-1"]
    with pytest.raises(InputError, match=r"trainer row 2 \(rollout 'step3-g1-0'.*no policy"):
        trainer_rows(rollouts, str)
    with pytest.raises(InputError, match="do not split into groups of num_generations=2"):
        group_rollouts(batch[:3], group_size=2, train_step=3)


def test_one_route_or_the_other():
    from draco_cli.errors import UsageError
    from draco_cli.trainers.trl import DracoGRPOTrainer

    with pytest.raises(UsageError, match="one of the two"):
        DracoGRPOTrainer(model=None)
    with pytest.raises(UsageError, match="one of the two"):
        DracoGRPOTrainer(model=None, judge="openai/m", token_advantages="a.parquet")
    with pytest.raises(UsageError, match="keep_steps 0"):
        DracoGRPOTrainer(model=None, judge="openai/m", keep_steps=0)
