"""In-loop scoring for verl 0.9.1 (draco_cli.trainers.verl.hook), on CPU in local Ray.

What runs for real: Ray actors for verl's agent-loop workers (draco's subclasses of verl's
AgentLoopWorker / AgentLoopWorkerTQ) created by verl's own AgentLoopManager(.TQ) ``create``,
verl's generate_sequences / _run_agent_loop (hydra-instantiating a registered AgentLoopBase) /
_agent_loop_postprocess / _postprocess (legacy) and _run_prompt + TransferQueue puts (V1), the
shared scorer actor judging against the project's protocol server, verl's ``_balance_batch``
(legacy and V1, with V1's padding rows) and verl's advantage step (legacy ``compute_advantage``,
V1 ``PPOTrainer._compute_advantage`` reading the real TransferQueue). Stand-ins: the agent loop
returns fixed token ids instead of calling an inference server (no GPU), and the workers'
``__init__`` sets the tokenizer and rollout config instead of loading an HF model directory.
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.trainers
pytest.importorskip("verl", reason="needs the trainers extra (verl 0.9.1)")
torch = pytest.importorskip("torch", reason="needs the trainers extra (torch)")
ray = pytest.importorskip("ray", reason="needs the trainers extra (ray)")
tq = pytest.importorskip("transfer_queue", reason="needs verl's TransferQueue")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta
    from verl.protocol import DataProto
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils import tensordict_utils as tu

from draco_cli.inloop import BlockingStepScorer, TrainerRollout
from draco_cli.trainers import verl as draco_verl
from draco_cli.trainers.loader import AlignmentError
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.trainers import verl_inloop_helpers as H
from tests.trainers.chatml import chatml_tokenizer

N = 8          # sessions per prompt (rollout.n)
PROMPTS = 2    # prompts per step
T = 48         # rollout.response_length


def _config(workers=4):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {
            "n": N, "prompt_length": 32, "response_length": T, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "calculate_log_probs": False,
            "agent": {"num_workers": workers, "default_agent_loop": H.AGENT},
            "val_kwargs": {"n": 1, "top_p": 1.0, "top_k": -1, "temperature": 0.0},
            "multi_turn": {}, "trace": {}}, "model": {}},
        "data": {"apply_chat_template_kwargs": {}},
    })


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("inloop")
    server = FakeLLMServer(answer=scripted, latency=0.02).start()
    settings = {"model": "openai/judge", "base_url": server.url + "/v1",
                "call_log": str(root / "llm_calls.sqlite"), "audit_dir": str(root / "audit"),
                "keep": 2, "deadline": 60}
    env = {draco_verl.ENV_SETTINGS: json.dumps(settings),
           "OPENAI_API_KEY": "sk-test-api-0000000000000"}
    if ray.is_initialized():
        ray.shutdown()
    # Logical CPUs for TransferQueue's controller and storage unit (num_cpus=1 each); the
    # agent-loop workers and the scorer ask for none.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "draco_cli.trainers.verl.setup",
                          "env_vars": env})
    draco_verl.setup()
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        yield SimpleNamespace(root=root, server=server, settings=settings)
    finally:
        ray.shutdown()
        server.stop()


def _prompts(step, two_outputs=False, equal=False):
    uids = [(H.TWO_OUTPUTS if two_outputs and i == 0 else H.EQUAL_MASKS if equal else "")
            + uuid.uuid4().hex for i in range(PROMPTS)]
    raw = [[{"role": "user", "content": f"task {i} of step {step}"}] for i in range(PROMPTS)]
    return uids, raw


def _answered_rows(path) -> int:
    import sqlite3
    from contextlib import closing

    try:   # closed here, not whenever the handle is collected (``with conn`` only commits)
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            return conn.execute("SELECT count(*) FROM calls WHERE status = 'ok'").fetchone()[0]
    except sqlite3.Error:
        return 0


def _expected(cluster, rows, before=0):
    """Each rollout's advantages from a StepScorer of its own over the same rollouts and call
    log: what draco gives that rollout (every call answered from the log)."""
    # the actor flushes its call log when its step ends, which may come just after the batch
    # is handed back: wait until its answers are on disk (more than ``before``, the count
    # before the step, and no new rows for a second)
    deadline, seen, still = time.time() + 60, -1, 0
    while time.time() < deadline and still < 5:
        n = _answered_rows(cluster.settings["call_log"])
        still = still + 1 if n == seen and n > before else 0
        seen = n
        time.sleep(0.2)
    tok = chatml_tokenizer()
    with BlockingStepScorer("openai/judge", base_url=cluster.settings["base_url"],
                            call_log=cluster.settings["call_log"], group_size=N,
                            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                            deadline=60) as s:
        res = s.score_step([TrainerRollout(**r) for r in rows], rows[0]["train_step"])
    # every answer replayed from the actor's call log: the same requests, none asked again
    # (a miss here was the actor's answers committed into a WAL another process had deleted,
    # and the union prompt following the sessions' arrival order; see docs/decisions.md)
    m = res.metrics
    assert m["draco/judge_calls"] == 0 and m["draco/cached_calls"] == seen - before > 0, m
    return {k: v.values for k, v in res.rows.items()}


def _rollout(uid, session, prompt, step, index=0):
    tok = chatml_tokenizer()
    ids, mask, reward = H.session_tokens(uid, session, index, uid.startswith(H.EQUAL_MASKS))
    return {"rollout_id": draco_verl.rollout_id(uid, session, index), "group_id": uid,
            "instruction": tok.decode(tok.encode(prompt), skip_special_tokens=True),
            "response_ids": ids, "response_mask": mask, "outcome": reward, "train_step": step}


def _balance_legacy(batch, dp):
    fake = SimpleNamespace(_get_dp_size=lambda wg, role: dp, actor_rollout_wg=None,
                           use_prefix_grouper=False, config=None)
    ray_trainer.RayPPOTrainer._balance_batch(fake, batch, metrics={})


@pytest.fixture(scope="module")
def legacy_manager(cluster):
    return H.CpuManager.create(config=_config(), llm_client=None)


def test_legacy_rows_carry_their_advantages(cluster, legacy_manager, monkeypatch):
    step = 1
    uids, raw = _prompts(step)
    rep = np.repeat(np.arange(PROMPTS), N)
    batch = DataProto.from_dict(
        tensors={"dummy": torch.zeros(len(rep), 1)},
        non_tensors={"uid": np.array([uids[i] for i in rep], dtype=object),
                     "raw_prompt": np.array([raw[i] for i in rep] + [None], dtype=object)[:-1],
                     "index": rep},
        meta_info={"global_steps": step})
    hits = sum(cluster.server.hits.values())
    out = legacy_manager.generate_sequences(batch)
    assert sum(cluster.server.hits.values()) > hits            # judged during generation
    nt = out.non_tensor_batch
    # 4 workers, chunks of 4 rows: every group ran on two workers. The legacy agent loop
    # received session_id (the docs' snippet's KeyError)
    assert sorted(nt["session_id"].tolist()) == sorted(list(range(N)) * PROMPTS)
    truth = [draco_verl.rollout_id(u, int(s)) for u, s in zip(nt["uid"], nt["session_id"])]
    assert list(nt[draco_verl.ROW_ID_FIELD]) == truth
    prompts = {u: raw[i][0]["content"] for i, u in enumerate(uids)}
    expected = _expected(cluster, [_rollout(u, int(s), prompts[u], step)
                                   for u, s in zip(nt["uid"], nt["session_id"])])
    out.batch["token_level_scores"] = out.batch["rm_scores"]
    out.batch["token_level_rewards"] = out.batch["rm_scores"]
    for dp in (2, 4, 8):
        data = out.slice(0, len(out))   # a fresh copy per dp size
        _balance_legacy(data, dp)
        order = list(data.non_tensor_batch[draco_verl.ROW_ID_FIELD])
        assert order != truth                                  # verl did reorder
        done = ray_trainer.compute_advantage(data, adv_estimator="draco", config={})
        got = done.batch["advantages"].numpy()
        want = np.zeros_like(got)
        for b, rid in enumerate(order):
            want[b, :len(expected[rid])] = expected[rid]
        np.testing.assert_array_equal(got, want)
        assert np.abs(got).sum() > 0
        if dp == 2:
            # draco's metrics join verl's own (compute_data_metrics → logger.log) once: the
            # step's groups are finished; later dp sizes re-run the same step's rows.
            logged = ray_trainer.compute_data_metrics(batch=done, use_critic=False)
            assert logged["draco/rollouts"] == PROMPTS * N
            assert logged["draco/fallback_groups"] == 0 and logged["draco/judge_calls"] > 0
            audit = cluster.root / "audit" / f"step-{step:06d}"
            written = json.loads((audit / "metrics.json").read_text())["metrics"]
            assert written.items() <= logged.items()
            monkeypatch.setattr("draco_cli.trainers.verl.scorer.finish_groups", lambda s: {})


@pytest.fixture(scope="module")
def v1_manager(cluster):
    return H.CpuManagerTQ.create(config=_config(workers=2), llm_client=None)


def _v1_generate(manager, step, two_outputs=False, equal=False):
    uids, raw = _prompts(step, two_outputs, equal)
    prompts = tu.get_tensordict({"uid": np.array(uids, dtype=object),
                                 "raw_prompt": np.array(raw + [None], dtype=object)[:-1],
                                 "index": np.arange(PROMPTS)})
    tu.assign_non_tensor_data(prompts, "global_steps", step)
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": step}] * PROMPTS)
    manager.generate_sequences(prompts)
    deadline = time.monotonic() + 120
    while True:
        listed = tq.kv_list(partition_id="train").get("train", {})
        status = [listed.get(u, {}).get("status") for u in uids]
        if all(s in ("finished", "failure") for s in status) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == ["finished"] * PROMPTS
    keys = [k for k in listed if k.rsplit("_", 2)[0] in uids and k not in uids]
    return uids, raw, KVBatchMeta(partition_id="train", keys=keys, tags=[listed[k] for k in keys])


def _v1_trainer(config, dp):
    """The attributes of verl's V1 PPOTrainer that its _balance_batch and _compute_advantage
    read (no GPU worker groups here)."""
    algo = OmegaConf.create({"adv_estimator": "draco", "use_kl_in_reward": False, "gamma": 1.0,
                             "lam": 1.0, "norm_adv_by_std_in_grpo": True})
    cfg = OmegaConf.merge(config, {"algorithm": algo, "trainer": {"critic_warmup": 1},
                                   "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1}}})
    wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp))})
    return SimpleNamespace(config=cfg, actor_rollout_wg=wg, use_critic=False, global_steps=0,
                           tokenizer=chatml_tokenizer(),
                           _get_required_batch_multiple=lambda d: d)


def _v1_advantages(trainer, batch, metrics):
    batch = trainer_base.PPOTrainer._balance_batch(trainer, batch, metrics={})
    # old_log_probs would come from the actor's compute_log_prob: zeros of the right shape
    rm = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["response_mask"])
    tq.kv_batch_put(keys=batch.keys, partition_id="train", fields=TensorDict(
        {"old_log_probs": torch.nested.as_nested_tensor(
            [m.float() * 0 for m in rm["response_mask"].unbind(0)], layout=torch.jagged)},
        batch_size=len(batch)))
    batch = trainer_base.PPOTrainer._compute_advantage(trainer, batch, metrics=metrics)
    got = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages"])
    return batch, [a.numpy() for a in got["advantages"].unbind(0)]


def test_v1_rows_carry_their_advantages_through_the_transfer_queue(cluster, v1_manager,
                                                                    monkeypatch):
    step = 11
    config = _config(workers=2)
    before = _answered_rows(cluster.settings["call_log"])
    uids, raw, batch = _v1_generate(v1_manager, step, two_outputs=True)
    assert len(batch) == PROMPTS * N + 1                        # one session gave two outputs
    prompts = {u: raw[i][0]["content"] for i, u in enumerate(uids)}
    last: dict[tuple[str, int], int] = {}
    for k in batch.keys:
        u, sess, i = k.rsplit("_", 2)
        last[(u, int(sess))] = max(last.get((u, int(sess)), 0), int(i))
    rows = [_rollout(u, sess, prompts[u], step, index=i) for (u, sess), i in last.items()]
    expected = _expected(cluster, rows, before)
    for dp in (2, 4, 8):
        metrics: dict = {}
        meta = KVBatchMeta(partition_id="train", keys=list(batch.keys), tags=list(batch.tags))
        meta, got = _v1_advantages(_v1_trainer(config, dp), meta, metrics)
        n_pad = sum(k.startswith("pad") for k in meta.keys)
        assert len(meta) % dp == 0 and n_pad == (-(PROMPTS * N + 1)) % dp and n_pad > 0
        assert meta.keys[:len(batch)] != batch.keys or dp == 2
        for key, adv in zip(meta.keys, got):
            uid, session, index = key.rsplit("_", 2)
            rid = draco_verl.rollout_id(uid, int(session), int(index))
            if key.startswith("pad"):
                np.testing.assert_array_equal(adv, 0)            # padding rows zero
            elif rid in expected:
                assert len(adv) == len(expected[rid])
                np.testing.assert_array_equal(adv, expected[rid])
            else:   # the session's earlier output: not scored, zero, said so
                assert uid.startswith(H.TWO_OUTPUTS) and index == "0"
                np.testing.assert_array_equal(adv, 0)
        if dp == 2:
            assert metrics["draco/rollouts"] == PROMPTS * N and metrics["draco/judge_calls"] > 0
            monkeypatch.setattr("draco_cli.trainers.verl.scorer.finish_groups", lambda s: {})
        tq.kv_clear(keys=[k for k in meta.keys if k.startswith("pad")], partition_id="train")
    tq.kv_clear(keys=batch.keys, partition_id="train")


def test_v1_file_route_checks_fingerprint_and_refuses_a_swapped_pair(cluster, v1_manager,
                                                                      monkeypatch):
    """The file path stays: V1 rows found by key in the step's token_advantages.parquet, now
    checked against the TransferQueue's responses (fingerprint) and global_steps (train step);
    equal masks in a group, so the count check alone would pass a swap; a file of another
    step is refused too."""
    import polars as pl

    step = 30
    config = _config(workers=2)
    _, _, batch = _v1_generate(v1_manager, step, equal=True)
    audit = cluster.root / "audit"
    # the in-loop values are dropped from the rows: the estimator must use the file
    arr = np.empty(len(batch), dtype=object)
    arr[:] = [{} for _ in batch.keys]
    tq.kv_batch_put(keys=batch.keys, partition_id="train",
                    fields=tu.get_tensordict({"extra_fields": arr}))
    trainer = _v1_trainer(config, 4)
    # the step's file, as the shared scorer's audit folder has it once the step finished
    from draco_cli.trainers.verl.scorer import finish_groups

    finish_groups({step: {k.rsplit("_", 2)[0] for k in batch.keys}})
    path = audit / f"step-{step:06d}" / "credit" / "token_advantages.parquet"
    table = pl.read_parquet(path)
    assert table["response_fingerprint"].null_count() == 0
    monkeypatch.setenv(draco_verl.ENV_FILES, str(path))
    _, got = _v1_advantages(trainer, KVBatchMeta(partition_id="train", keys=list(batch.keys),
                                                 tags=list(batch.tags)), {})
    assert sum(np.abs(a).sum() for a in got) > 0
    # two rollouts of one group swap ids in the file (a logger's mistake): refused
    ids = table["rollout_id"].to_list()
    g = ids[0].rsplit("_", 1)[0]
    a, b = [i for i, r in enumerate(ids) if r.startswith(g)][:2]
    ids[a], ids[b] = ids[b], ids[a]
    swapped = path.with_name("swapped.parquet")
    table.with_columns(pl.Series("rollout_id", ids)).write_parquet(swapped)
    monkeypatch.setenv(draco_verl.ENV_FILES, str(swapped))
    with pytest.raises(AlignmentError, match="response_fingerprint"):
        _v1_advantages(trainer, KVBatchMeta(partition_id="train", keys=list(batch.keys),
                                            tags=list(batch.tags)), {})
    # the right rows of another train step (a stale file): refused by the rows' global_steps
    stale = path.with_name("stale.parquet")
    table.with_columns(pl.lit(step + 1, dtype=table.schema["train_step"]).alias("train_step")) \
        .write_parquet(stale)
    monkeypatch.setenv(draco_verl.ENV_FILES, str(stale))
    with pytest.raises(AlignmentError, match="train step"):
        _v1_advantages(trainer, KVBatchMeta(partition_id="train", keys=list(batch.keys),
                                            tags=list(batch.tags)), {})
    tq.kv_clear(keys=batch.keys, partition_id="train")
