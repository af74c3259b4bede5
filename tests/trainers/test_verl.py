"""draco_cli.trainers.verl against verl 0.9.1's own code on CPU.

verl's ``_balance_batch`` reorders the batch exactly as the trainer does before computing
advantages; the draco estimator then runs through verl's own ``compute_advantage`` (legacy) and
``compute_advantage_for_multi_trajectories`` (V1), reached by the names verl calls.
"""

from __future__ import annotations

import uuid
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from draco_cli.trainers.loader import AlignmentError, group_rollout_ids, load_token_advantages
from tests.trainers.draco_files import (
    draco_token_file,
    expected_rows,
    make_rollouts,
    padded,
)

pytestmark = pytest.mark.trainers
verl = pytest.importorskip("verl", reason="needs the trainers extra (verl 0.9.1)")
torch = pytest.importorskip("torch", reason="needs the trainers extra (torch)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from verl.protocol import DataProto
    from verl.trainer.ppo import core_algos, ray_trainer
    from verl.trainer.ppo.v1 import utils as v1_utils

from draco_cli.trainers import verl as draco_verl

P = 12  # prompt tokens


def _batch(rollouts, T, rng, extra_non_tensor):
    """A verl DataProto as the agent loop leaves it: left-padded prompts of random length,
    right-padded responses, uid per row, plus the per-row fields given."""
    B = len(rollouts)
    plen = rng.integers(4, P + 1, size=B)
    prompts = np.zeros((B, P), dtype=np.int64)
    pmask = np.zeros((B, P), dtype=np.int64)
    for b, n in enumerate(plen):
        prompts[b, P - n:] = rng.integers(3, 1000, size=n)
        pmask[b, P - n:] = 1
    responses = padded([r.response_ids for r in rollouts], T)
    rmask = padded([r.response_mask for r in rollouts], T)
    ramask = padded([[1] * len(r.response_mask) for r in rollouts], T)
    tensors = {
        "prompts": torch.as_tensor(prompts), "responses": torch.as_tensor(responses),
        "input_ids": torch.as_tensor(np.concatenate([prompts, responses], 1)),
        "attention_mask": torch.as_tensor(np.concatenate([pmask, ramask], 1)),
        "response_mask": torch.as_tensor(rmask),
        "token_level_rewards": torch.zeros(B, T),
    }
    non_tensors = {"uid": np.array([r.group for r in rollouts], dtype=object),
                   **{k: np.array(v, dtype=object) for k, v in extra_non_tensor.items()}}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _balance(batch, dp):
    """verl's own RayPPOTrainer._balance_batch, with the dp size the trainer would ask for."""
    fake = SimpleNamespace(_get_dp_size=lambda wg, role: dp, actor_rollout_wg=None,
                           use_prefix_grouper=False, config=None)
    ray_trainer.RayPPOTrainer._balance_batch(fake, batch, metrics={})


@pytest.fixture(scope="module", autouse=True)
def _setup_once(tmp_path_factory):
    draco_verl.setup()
    yield


@pytest.mark.parametrize("lengths", ["equal", "random"])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_legacy_balance_batch_every_row_exact(tmp_path, monkeypatch, lengths, dp):
    rng = np.random.default_rng(dp)
    T = 24
    groups = [uuid.UUID(int=int(rng.integers(1 << 62))).hex for _ in range(16)]
    rollouts = make_rollouts(rng, groups, 8, lengths=lengths, T=T, turns=2)
    # The rollout logger numbers a group's rollouts in generation order, which is also
    # what the old order-based ids assume.
    path = draco_token_file(tmp_path, rollouts, rng=rng)
    monkeypatch.setenv(draco_verl.ENV_FILES, str(path))
    batch = _batch(rollouts, T, rng, {draco_verl.ROW_ID_FIELD: [r.rollout_id for r in rollouts],
                                      "truth": [r.rollout_id for r in rollouts]})
    _balance(batch, dp)
    truth = list(batch.non_tensor_batch["truth"])
    assert truth != [r.rollout_id for r in rollouts]  # verl did reorder

    out = ray_trainer.compute_advantage(batch, adv_estimator="draco", config={})
    got = out.batch["advantages"].numpy()
    np.testing.assert_array_equal(got, expected_rows(path, truth, T))

    # The old order-based ids, on the same reordered batch: rows land on other rollouts.
    # (With equal masks nothing in the data can tell; with random lengths strict mode may
    # notice, which is the lucky case.)
    table = load_token_advantages(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old_ids = [i.replace(":", "_") for i in group_rollout_ids(batch.non_tensor_batch["uid"])]
    wrong = sum(o != t for o, t in zip(old_ids, truth))
    print(f"\nverl dp={dp} {lengths}: order-based ids name another rollout on {wrong} of "
          f"{len(truth)} rows; per-row ids on 0")
    assert wrong > 0
    if lengths == "equal":
        # Same masks everywhere: the old path passes strict mode and is silently wrong ...
        old = table.batch(old_ids, batch.batch["response_mask"].numpy())
        rows_wrong = int((old != got).any(axis=1).sum())
        print(f"verl dp={dp} equal masks: the old path passes strict mode with wrong values on "
              f"{rows_wrong} of {len(truth)} rows")
        assert rows_wrong > 0
        # ... where a count check cannot help either, but the fingerprint does.
        with pytest.raises(AlignmentError, match="response_fingerprint"):
            table.batch(old_ids, batch.batch["response_mask"].numpy(),
                        response_ids=batch.batch["responses"].numpy())


def test_v1_keys_padding_rows_and_multi_output(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    T = 20
    uids = [str(uuid.uuid4()) for _ in range(4)]
    rollouts = make_rollouts(rng, uids, 4, lengths="random", T=T, turns=2,
                             id_of=lambda g, k: draco_verl.rollout_id(g, k))
    # Session 1 of the first prompt had a second agent-loop output (index 1): its own rollout.
    extra = make_rollouts(rng, [uids[0]], 1, lengths="random", T=T, turns=1,
                          id_of=lambda g, k: draco_verl.rollout_id(g, 1, 1))
    path = draco_token_file(tmp_path, rollouts + extra, rng=rng)
    monkeypatch.setenv(draco_verl.ENV_FILES, str(path))
    keys = [f"{r.group}_{k % 4}_0" for k, r in enumerate(rollouts)] + [f"{uids[0]}_1_1"]
    # verl's V1 padding rows: uid pad<hex>, one response token, mask 1 on it.
    pad_uid = f"pad{uuid.uuid4().hex}"
    pad = [SimpleNamespace(group=pad_uid, response_ids=[2], response_mask=[1],
                           rollout_id=None) for _ in range(3)]
    keys += [f"{pad_uid}_{i}_0" for i in range(3)]
    rows = rollouts + extra + pad
    batch = _batch(rows, T, rng, {"key": keys, "truth": [r.rollout_id for r in rows]})
    _balance(batch, 4)
    out = v1_utils.compute_advantage_for_multi_trajectories(
        batch, batch_keys=list(batch.non_tensor_batch["key"]), adv_estimator="draco",
        config={})
    np.testing.assert_array_equal(out.batch["advantages"].numpy(),
                                  expected_rows(path, list(batch.non_tensor_batch["truth"]), T))
    # A padding row is zero only because it is marked: an unknown non-padding key is an error.
    bad = list(batch.non_tensor_batch["key"])
    b = bad.index(f"{pad_uid}_0_0")
    bad[b] = "not-a-rollout_0_0"
    with pytest.raises(AlignmentError, match=rf"no token advantages for rollout "
                                             rf"'not-a-rollout_0'.*trainer row {b}"):
        v1_utils.compute_advantage_for_multi_trajectories(
            batch, batch_keys=bad, adv_estimator="draco", config={})


def test_estimator_without_row_ids_refuses(monkeypatch, tmp_path):
    fn = core_algos.get_adv_estimator_fn("draco")
    with pytest.raises(AlignmentError, match="per-row ids are unknown"):
        fn(torch.zeros(2, 3), torch.ones(2, 3), config={}, index=np.array(["u", "u"]))


def test_several_step_files_for_async_batches(tmp_path, monkeypatch):
    """An async trainer's batch mixes rollouts of two generation steps: each row is found in
    its own step's file, which records that step."""
    rng = np.random.default_rng(3)
    T = 16
    old = make_rollouts(rng, ["a", "b"], 2, lengths="random", T=T, turns=2)
    new = make_rollouts(rng, ["c", "d"], 2, lengths="random", T=T, turns=2)
    p1 = draco_token_file(tmp_path, old, train_step=1, rng=rng, name="step-1")
    p2 = draco_token_file(tmp_path, new, train_step=2, rng=rng, name="step-2")
    monkeypatch.setenv(draco_verl.ENV_FILES, str(tmp_path / "step-*" / "credit" /
                                                 "token_advantages.parquet"))
    rows = old + new
    steps = [1] * len(old) + [2] * len(new)
    batch = _batch(rows, T, rng, {draco_verl.ROW_ID_FIELD: [r.rollout_id for r in rows],
                                  draco_verl.STEP_FIELD: steps,
                                  "truth": [r.rollout_id for r in rows]})
    _balance(batch, 2)
    out = ray_trainer.compute_advantage(batch, adv_estimator="draco", config={})
    np.testing.assert_array_equal(out.batch["advantages"].numpy(),
                                  expected_rows([p1, p2], list(batch.non_tensor_batch["truth"]),
                                                T))
    table = load_token_advantages([p1, p2])
    assert [table.train_step(r.rollout_id) for r in rows] == [1] * 4 + [2] * 4
    # A row that claims another step than its file records is refused, naming both.
    claimed = np.array(batch.non_tensor_batch[draco_verl.STEP_FIELD], dtype=object)
    claimed[0] = 3 - claimed[0]
    batch.non_tensor_batch[draco_verl.STEP_FIELD] = claimed
    with pytest.raises(AlignmentError, match=r"trainer row 0\): the file is from train step"):
        ray_trainer.compute_advantage(batch, adv_estimator="draco", config={})


def test_setup_hook_reaches_a_ray_actor(tmp_path):
    """The estimator runs in verl's TaskRunner, a Ray actor in another process: a registration
    in the launch script does not reach it, the worker_process_setup_hook does."""
    ray = pytest.importorskip("ray", reason="needs the trainers extra (ray)")
    rng = np.random.default_rng(5)
    T = 16
    rollouts = make_rollouts(rng, ["u1", "u2"], 4, lengths="random", T=T, turns=2)
    path = draco_token_file(tmp_path, rollouts, rng=rng)
    batch = _batch(rollouts, T, rng, {draco_verl.ROW_ID_FIELD: [r.rollout_id for r in rollouts],
                                      "truth": [r.rollout_id for r in rollouts]})
    _balance(batch, 2)
    core_algos.register_adv_est("launch_script_only")(lambda **kw: None)
    if ray.is_initialized():   # joined by an earlier in-process test: this one needs its hook
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "draco_cli.trainers.verl.setup",
                          "env_vars": {draco_verl.ENV_FILES: str(path)}})
    try:
        @ray.remote(num_cpus=1)
        class TaskRunner:
            def run(self, tensors, non_tensors):
                import warnings

                warnings.simplefilter("ignore")
                from verl.protocol import DataProto
                from verl.trainer.ppo import core_algos, ray_trainer

                data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
                out = ray_trainer.compute_advantage(data, adv_estimator="draco", config={})
                return (sorted(core_algos.ADV_ESTIMATOR_REGISTRY),
                        out.batch["advantages"].numpy())

        tensors = {k: batch.batch[k] for k in ("responses", "response_mask",
                                               "token_level_rewards", "attention_mask")}
        names, adv = ray.get(TaskRunner.remote().run.remote(tensors,
                                                            dict(batch.non_tensor_batch)))
    finally:
        ray.shutdown()
    assert "draco" in names and "launch_script_only" not in names
    np.testing.assert_array_equal(adv, expected_rows(path, list(batch.non_tensor_batch["truth"]),
                                                     T))
