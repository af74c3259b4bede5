"""draco_cli.trainers.skyrl against skyrl-train 0.3.1's own code on CPU.

The generator input is built by SkyRL's ``prepare_generator_input``; the batch goes through
``RayPPOTrainer``'s own ``generate`` (``validate_generator_output``), ``postprocess_generator_output``,
``convert_to_training_input`` (right-padding, ``pad_batch`` to the data-parallel size) and
``compute_advantages_and_returns`` with the estimator looked up in SkyRL's real
``AdvantageEstimatorRegistry``; rows are reordered by SkyRL's ``filter_generator_output`` (the
dynamic-sampling filter's function). Only the inner generator (the LLM + environment) is
scripted: it returns multi-turn token ids and loss masks as ``SkyRLGymGenerator`` does.
skyrl-train needs Python 3.12 by its metadata; its code runs here on 3.11 (see docs/trainers.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.trainers
torch = pytest.importorskip("torch", reason="needs the skyrl extra (torch)")
pytest.importorskip("skyrl_train", reason="needs the skyrl extra (skyrl-train 0.3.1)")
from omegaconf import OmegaConf
from skyrl_train.generators.base import TrajectoryID
from skyrl_train.generators.utils import prepare_generator_input
from skyrl_train.trainer import RayPPOTrainer
from skyrl_train.utils import trainer_utils

from draco_cli.errors import InputError, UsageError
from draco_cli.inloop import BlockingStepScorer, TrainerRollout
from draco_cli.trainers import skyrl as dsky
from draco_cli.trainers.skyrl_export import dump_records
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted

N, PROMPTS, STEP, DP = 4, 3, 3, 5
DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"
# the SkyRL section's Python blocks carry the info string "python skyrl": this test runs them
BLOCKS = re.findall(r"```python skyrl\n(.*?)```", DOC.read_text(), re.DOTALL)


def _doc_block(word):
    found = [b for b in BLOCKS if word in b]
    assert len(found) == 1, word
    return found[0]


def _run_block(block, ns, cwd, rename=None):
    for old, new in (rename or {}).items():
        block = block.replace(old, new)
    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(block, str(DOC), "exec"), ns)
    finally:
        os.chdir(here)


def test_every_skyrl_block_is_run():
    assert len(BLOCKS) == 2 and _doc_block("DracoGenerator") and _doc_block("load_export")


class Scripted:
    """The inner generator: multi-turn responses as SkyRLGymGenerator returns them in
    non-step-wise mode (no trajectory_ids, no is_last_step), a 0/1 outcome per row."""

    def __init__(self, tok, seed=0, echo_ids=False, same_group=None):
        self.tok, self.rng, self.echo_ids = tok, np.random.default_rng(seed), echo_ids
        self.same_group = same_group   # that group's members: one response, one outcome
        self.calls = 0

    async def generate(self, input_batch):
        self.calls += 1
        out = {k: [] for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks",
                               "stop_reasons")}
        for conv in input_batch["prompts"]:
            out["prompt_token_ids"].append(self.tok.encode(conv[0]["content"]))
            ids, mask = [], []
            for t in range(int(self.rng.integers(1, 4))):
                if t:
                    obs = self.rng.integers(3, 300, size=int(self.rng.integers(1, 6))).tolist()
                    ids += obs
                    mask += [0] * len(obs)
                act = self.rng.integers(3, 300, size=int(self.rng.integers(2, 12))).tolist()
                ids += act
                mask += [1] * len(act)
            k = len(out["rewards"])
            if k // N == self.same_group and k % N:
                ids, mask = list(out["response_ids"][k - 1]), list(out["loss_masks"][k - 1])
            out["response_ids"].append(ids)
            out["loss_masks"].append(mask)
            out["rewards"].append(1.0 if k // N == self.same_group else
                                  float(self.rng.integers(0, 2)))
            out["stop_reasons"].append("stop")
        out.update(rollout_metrics=None, rollout_logprobs=None, is_last_step=None,
                   trajectory_ids=list(input_batch["trajectory_ids"]) if self.echo_ids else None)
        return out


def _cfg(**algorithm):
    from importlib.resources import files

    cfg = OmegaConf.load(str(files("skyrl_train") / "config" / "ppo_base_config.yaml"))
    cfg.generator.n_samples_per_prompt = N
    cfg.trainer.algorithm.advantage_estimator = dsky.ESTIMATOR
    for k, v in algorithm.items():
        OmegaConf.update(cfg, f"trainer.algorithm.{k}", v)
    return cfg


def _trainer(tok, generator, cfg):
    t = RayPPOTrainer.__new__(RayPPOTrainer)
    t.cfg, t.tokenizer, t.generator, t.all_metrics = cfg, tok, generator, {}
    t.policy_model = SimpleNamespace(actor_infos=[SimpleNamespace(rank=SimpleNamespace(dp_size=DP))])
    t.critic_model = t.ref_model = None
    return t


def _input():
    prompts = [{"prompt": [{"role": "user", "content": f"Find the flights, task {g}"}],
                "env_class": None, "env_extras": {}, "uid": f"p{g}"} for g in range(PROMPTS)]
    return prepare_generator_input(prompts, N, {}, "gsm8k", "train", STEP)


@pytest.fixture(scope="module")
def tok():
    from tests.trainers.chatml import chatml_tokenizer

    return chatml_tokenizer()


@pytest.fixture
def judge(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


@pytest.fixture
def scorer(judge, tok, tmp_path):
    with BlockingStepScorer("openai/m", base_url=judge.url + "/v1", group_size=N,
                            decode=tok.decode, call_log=tmp_path / "a.sqlite") as s:
        yield s


def _train_step(trainer, gen_input, uids, perm=None, edit=None):
    """SkyRL's own trainer path from generation to advantages (optionally reordered/edited)."""
    out = asyncio.run(trainer.generate(gen_input))
    if perm is not None:
        out = trainer_utils.filter_generator_output(out, perm)
        uids = [uids[i] for i in perm]
    out = trainer.postprocess_generator_output(out, uids)
    if edit is not None:
        edit(out)
    batch = trainer.convert_to_training_input(out, uids)
    batch["values"] = None
    return out, uids, trainer.compute_advantages_and_returns(batch)


def _registered(gen):
    dsky.register_estimator(gen.deliveries)


def test_every_value_on_its_token_through_skyrl(tok, scorer, judge, tmp_path):
    inner = Scripted(tok)
    gen = dsky.DracoGenerator(inner, scorer, decode=tok.decode, steps_dir=tmp_path / "steps")
    _registered(gen)
    trainer = _trainer(tok, gen, _cfg())
    gen_input, uids = _input()
    perm = [int(i) for i in np.random.default_rng(1).permutation(N * PROMPTS)]
    assert perm != sorted(perm)
    out, kept_uids, data = _train_step(trainer, gen_input, uids, perm=perm)
    assert data.metadata["pad_size"] == (-N * PROMPTS) % DP > 0
    # the rollouts draco scored, rebuilt here from the inner generator's own rows
    ids = [t.to_string() for t in gen_input["trajectory_ids"]]
    assert all(isinstance(t, TrajectoryID) for t in gen_input["trajectory_ids"])
    adv = data["advantages"].numpy()
    loss_mask = data["loss_mask"].numpy()
    want = {}
    with BlockingStepScorer("openai/m", base_url=judge.url + "/v1", group_size=N,
                            decode=tok.decode, call_log=tmp_path / "b.sqlite") as s:
        again = Scripted(tok)   # same seed: the same rows
        raw = asyncio.run(again.generate(gen_input))
        rows = [TrainerRollout(ids[i], uids[i], tok.decode(raw["prompt_token_ids"][i]),
                               raw["response_ids"][i], raw["loss_masks"][i],
                               outcome=raw["rewards"][i], task_id=uids[i], train_step=STEP,
                               row=i) for i in range(len(ids))]
        own = s.score_step(rows, STEP)
        want = {rid: own.rows[rid].values for rid in ids}
    assert not own.fallbacks and any(np.abs(v).sum() > 0 for v in want.values())
    for b, i in enumerate(perm):
        v = want[ids[i]]
        np.testing.assert_array_equal(adv[b, :len(v)], v)
        assert not adv[b, len(v):].any()
        assert not adv[b][loss_mask[b] == 0].any()     # observation and padding tokens: 0
        assert kept_uids[b] == uids[i]
    assert (tmp_path / "steps" / f"step-{STEP:06d}" / "credit" / "token_advantages.parquet").exists()
    assert "draco/fallback_groups" in trainer.all_metrics
    # values differ from SkyRL's own GRPO on the same batch: the pass-through is not a no-op
    assert not np.allclose(adv[:, 0], adv[0, 0])


def test_eval_batches_pass_through(tok, scorer):
    gen = dsky.DracoGenerator(Scripted(tok), scorer, decode=tok.decode)
    gen_input, _ = _input()
    gen_input["batch_metadata"].training_phase = "eval"
    out = asyncio.run(gen.generate(gen_input))
    assert all(isinstance(r, float) for r in out["rewards"]) and not gen.deliveries.by_uid


def test_swapped_pair_refused_by_the_generator(tok, scorer):
    class Swapping(Scripted):
        async def generate(self, input_batch):
            out = await super().generate(input_batch)
            t = out["trajectory_ids"]
            t[0], t[N] = t[N], t[0]
            return out

    gen = dsky.DracoGenerator(Swapping(tok, echo_ids=True), scorer, decode=tok.decode)
    with pytest.raises(InputError, match="generator row 0 is trajectory 'p1_0'"):
        asyncio.run(gen.generate(_input()[0]))


@pytest.mark.parametrize("edit,match", [
    ("swap", "none of the values draco delivered"),
    ("cut", "a length mismatch"),
])
def test_estimator_refuses_rows_changed_after_delivery(tok, scorer, edit, match):
    gen = dsky.DracoGenerator(Scripted(tok), scorer, decode=tok.decode)
    _registered(gen)
    trainer = _trainer(tok, gen, _cfg())
    gen_input, uids = _input()

    def change(out):
        if edit == "swap":   # rewards of rows 0 and N (two groups) trade places, tokens stay
            r = out["rewards"]
            r[0], r[N] = r[N], r[0]
            for k in ("response_ids", "loss_masks"):
                out[k][0], out[k][N] = out[k][0], out[k][N]
            n0, nN = len(out["response_ids"][0]), len(out["response_ids"][N])
            r[0] = (r[0] + [0.0] * n0)[:n0]
            r[N] = (r[N] + [0.0] * nN)[:nN]
        else:                # a response cut by one token after draco scored it
            for k in ("response_ids", "loss_masks", "rewards"):
                out[k][1] = out[k][1][:-1]

    with pytest.raises(InputError, match=match):
        _train_step(trainer, gen_input, uids, edit=change)


@pytest.mark.parametrize("setting", ["use_kl_in_reward", "advantage_batch_normalize"])
def test_settings_that_change_the_values_refused(tok, scorer, setting):
    gen = dsky.DracoGenerator(Scripted(tok), scorer, decode=tok.decode)
    _registered(gen)
    trainer = _trainer(tok, gen, _cfg(**{setting: True}))
    gen_input, uids = _input()
    with pytest.raises(UsageError, match=setting):
        _train_step(trainer, gen_input, uids)


def test_step_wise_refused(tok, scorer):
    class StepWise(Scripted):
        async def generate(self, input_batch):
            out = await super().generate(input_batch)
            out["is_last_step"] = [i % 2 == 1 for i in range(len(out["response_ids"]))]
            return out

    gen = dsky.DracoGenerator(StepWise(tok), scorer, decode=tok.decode)
    with pytest.raises(UsageError, match="SkyRL #1492"):
        asyncio.run(gen.generate(_input()[0]))


def test_estimator_without_the_generator_refused():
    fn = dsky.draco_estimator(dsky.Deliveries())
    with pytest.raises(UsageError, match="DracoGenerator"):
        fn(token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3),
           index=["a", "a"])


def _draco(*args, cwd):
    env = {**os.environ, "OPENAI_API_KEY": "sk-test-api-0000000000000"}
    return subprocess.run([sys.executable, "-m", "draco_cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=env)


def test_ingest_run_export_round_trip(tok, judge, tmp_path):
    """SkyRL records → draco ingest skyrl → draco run → draco export --to skyrl → SkyRL's
    trainer with the draco estimator: each row gets exactly its token_advantages values."""
    gen_input, uids = _input()
    raw = asyncio.run(Scripted(tok, seed=5).generate(gen_input))
    raw["trajectory_ids"] = gen_input["trajectory_ids"]
    rec = dump_records(raw, tmp_path / "gen.json", global_step=STEP)
    tok.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    r = _draco("ingest", "skyrl", rec, "--tokenizer", tmp_path / "tokenizer.json",
               "-o", tmp_path / "ing", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _draco("run", "--rollouts", tmp_path / "ing" / "rollouts.parquet", "--steps",
               tmp_path / "ing" / "steps.parquet", "--model", "openai/m", "--base-url",
               judge.url + "/v1", "-o", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _draco("export", "--to", "skyrl", "--advantages", tmp_path / "run", "--records", rec,
               "-o", tmp_path / "exp.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _draco("validate", tmp_path / "ing", tmp_path / "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    from draco_cli.trainers.loader import load_token_advantages

    table = load_token_advantages(tmp_path / "run" / "credit" / "token_advantages.parquet")
    ns: dict = {}
    _run_block(_doc_block("load_export"), ns, tmp_path, rename={"step-3.draco.json": "exp.json"})
    exported = ns["output"]
    assert isinstance(ns["deliveries"], dsky.Deliveries)
    ids = [t.to_string() for t in gen_input["trajectory_ids"]]
    assert exported["draco"]["rollout_ids"] == ids

    class Replay:     # the exported rows as a generator's output, for SkyRL's trainer
        async def generate(self, _):
            return {**exported, "rollout_metrics": None, "rollout_logprobs": None,
                    "trajectory_ids": None, "is_last_step": None}

    trainer = _trainer(tok, Replay(), _cfg())
    _, _, data = _train_step(trainer, gen_input, uids)
    adv = data["advantages"].numpy()
    for b, rid in enumerate(ids):
        v = table.get(rid)
        np.testing.assert_array_equal(adv[b, :len(v)], v)
    # records whose two rows swapped ids: refused by the fingerprint self-check
    bad = json.loads(rec.read_text())
    t = bad["trajectory_ids"]
    t[0], t[N] = t[N], t[0]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = _draco("export", "--to", "skyrl", "--advantages", tmp_path / "run", "--records",
               tmp_path / "bad.json", "-o", tmp_path / "exp2.json", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "bad.json" in r.stderr
    assert not (tmp_path / "exp2.json").exists()


def test_in_loop_block(tok, judge, tmp_path):
    """The docs' wiring block, then SkyRL's trainer path on its generator and cfg."""
    ns = {"JUDGE_URL": judge.url + "/v1", "cfg": _cfg(advantage_estimator="grpo"),
          "tokenizer": tok, "generator": Scripted(tok)}
    _run_block(_doc_block("DracoGenerator"), ns, tmp_path)
    try:
        assert ns["cfg"].trainer.algorithm.advantage_estimator == "draco"
        trainer = _trainer(tok, ns["generator"], ns["cfg"])
        gen_input, uids = _input()
        _, _, data = _train_step(trainer, gen_input, uids)
        assert data["advantages"].abs().sum() > 0
        assert (tmp_path / "runs" / "skyrl" / "steps" / f"step-{STEP:06d}").is_dir()
    finally:
        ns["scorer"].close()


def test_replace_sampling_duplicates_rows_with_their_values(tok, scorer):
    """SkyRL's dynamic sampling 'replace' copies good groups' rows over a zero-variance group
    (here: a group of four identical rollouts, equal values): the copies carry
    their values and pass the estimator's check, each with the values of the row it copies."""
    gen = dsky.DracoGenerator(Scripted(tok, seed=2, same_group=1), scorer, decode=tok.decode)
    _registered(gen)
    trainer = _trainer(tok, gen, _cfg())
    gen_input, uids = _input()
    out = asyncio.run(trainer.generate(gen_input))
    before = [list(r) for r in out["response_ids"]]
    values = {tuple(r): v for r, v in zip(before, out["rewards"])}
    assert len({tuple(v) for v in out["rewards"][N:2 * N]}) == 1
    out, new_uids, keep = trainer_utils.handle_replace_sampling(
        out, uids, {"n_samples_per_prompt": N, "min_replace_ratio": 0.3})
    assert not keep and new_uids[N:2 * N] != uids[N:2 * N]       # group 1 replaced
    out = trainer.postprocess_generator_output(out, new_uids)
    batch = trainer.convert_to_training_input(out, new_uids)
    batch["values"] = None
    adv = trainer.compute_advantages_and_returns(batch)["advantages"].numpy()
    for b, r in enumerate(out["response_ids"]):
        v = values[tuple(r)]
        np.testing.assert_array_equal(adv[b, :len(v)], np.asarray(v, dtype=np.float32))


@pytest.mark.parametrize("change,match", [
    (lambda r: r.pop("loss_masks"), "field 'loss_masks'"),
    (lambda r: r["loss_masks"][2].append(1), "row 2: .* loss_masks entries"),
    (lambda r: r["trajectory_ids"].pop(), "trajectory_ids"),
    (lambda r: r["trajectory_ids"][1].pop("repetition_id"), "repetition_id"),
])
def test_bad_records_refused_naming_the_field(tok, tmp_path, change, match):
    from draco_cli.ingest.skyrl import ingest

    gen_input, _ = _input()
    raw = asyncio.run(Scripted(tok).generate(gen_input))
    raw["trajectory_ids"] = gen_input["trajectory_ids"]
    rec = json.loads(dump_records(raw, tmp_path / "gen.json").read_text())
    change(rec)
    (tmp_path / "gen.json").write_text(json.dumps(rec))
    tok.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(InputError, match=match):
        ingest([tmp_path / "gen.json"], tmp_path / "out", tokenizer=str(tmp_path / "tokenizer.json"),
               train_step=None, force=False)
    assert not (tmp_path / "out" / "rollouts.parquet").exists()


def test_ingest_needs_a_tokenizer_and_export_needs_records(tmp_path):
    from draco_cli.ingest.skyrl import ingest
    from draco_cli.trainers.skyrl_export import export_records

    with pytest.raises(UsageError, match="--tokenizer"):
        ingest([tmp_path / "x.json"], tmp_path / "o", tokenizer=None, train_step=None,
               force=False)
    with pytest.raises(UsageError, match="--records"):
        export_records(tmp_path, tmp_path / "o.json", records=None)
