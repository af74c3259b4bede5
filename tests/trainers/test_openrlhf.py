"""draco_cli.trainers.openrlhf against OpenRLHF 0.11.2's own code on CPU.

Experiences are built by OpenRLHF's ``SamplesGenerator._process_response_into_experience`` from
agent outputs shaped as its ``utils/agent.py`` returns them (observation tokens, action ranges,
extra_logs), then regrouped by its ``RemoteExperienceMaker.split_rollout_samples`` with dynamic
batching (length-balanced partitions: rows change order and padding). DeepSpeed, vLLM and
flash-attn cannot install on CPU; ``stubs`` stands in for them at import time only.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.trainers import stubs
from tests.trainers.draco_files import Rollout, draco_token_file, expected_rows

pytestmark = pytest.mark.trainers
torch = pytest.importorskip("torch", reason="needs the trainers extra (torch)")
pytest.importorskip("openrlhf", reason="needs the trainers extra (OpenRLHF 0.11.2)")
with stubs.installed():
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from draco_cli.trainers import openrlhf as draco_orl

    _ = draco_orl.DracoExperienceMaker  # built now, while OpenRLHF's imports resolve
from draco_cli.trainers.loader import AlignmentError, load_token_advantages

MAX_LEN = 200


def _agent_outputs(rng, n_groups=6, n=4):
    """Agent results as openrlhf.utils.agent returns them, and the rollouts draco logs."""
    outputs, rollouts = [], []
    for g in range(n_groups):
        for k in range(n):
            rid = str(1000 + 10 * g + k)
            prompt = rng.integers(3, 900, size=int(rng.integers(5, 30))).tolist()
            obs, ranges, mask = list(prompt), [], []
            turns = int(rng.integers(1, 4))
            for t in range(turns):
                action = rng.integers(3, 900, size=int(rng.integers(2, 20))).tolist()
                ranges.append((len(obs), len(obs) + len(action)))
                obs += action
                mask += [1] * len(action)
                if t < turns - 1:
                    feedback = rng.integers(3, 900, size=int(rng.integers(1, 10))).tolist()
                    obs += feedback
                    mask += [0] * len(feedback)
            outputs.append({"prompt": f"task {g}", "label": "", "images": None,
                            "mm_train_inputs": None, "reward": float(rng.random()),
                            "scores": 0.0, "observation_tokens": obs, "action_ranges": ranges,
                            "rollout_log_probs": None, "truncated": False,
                            "extra_logs": {draco_orl.ID_KEY: int(rid),
                                           draco_orl.STEP_KEY: 7}})
            rollouts.append(Rollout(rid, f"g{g}", obs[len(prompt):], mask,
                                    [f"turn {t}" for t in range(turns)]))
    return outputs, rollouts


def _experiences(outputs):
    gen = SamplesGenerator.__new__(SamplesGenerator)  # only the method's own code runs
    return [gen._process_response_into_experience(o, max_len=MAX_LEN) for o in outputs]


def _regroup(samples):
    args = SimpleNamespace(
        train=SimpleNamespace(dynamic_batch_enable=True),
        actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=4),
        ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
        rollout=SimpleNamespace(max_tokens_per_gpu=300, micro_batch_size=4))
    maker = SimpleNamespace(args=args, tokenizer=SimpleNamespace(pad_token_id=0))
    return RemoteExperienceMaker.split_rollout_samples(maker, samples)


def _truth(e):
    return [str(int(v)) for v in e.info[draco_orl.ID_KEY].tolist()]


def _expected_on_actions(path, e):
    """Expected [B, A]: each row's response values placed at its prompt offset."""
    mask = e.action_mask.numpy().astype(bool)
    ids = _truth(e)
    A = mask.shape[1]
    resp = expected_rows(path, ids, A)
    out = np.zeros_like(resp)
    for b in range(len(ids)):
        c = int(np.argmax(mask[b]))
        out[b, c:] = resp[b, : A - c]
    return out


@pytest.fixture
def made(tmp_path):
    rng = np.random.default_rng(11)
    outputs, rollouts = _agent_outputs(rng)
    path = draco_token_file(tmp_path, rollouts, train_step=7, rng=rng)
    return path, _experiences(outputs)


def test_values_land_on_action_tokens_before_and_after_reordering(made):
    path, singles = made
    table = load_token_advantages(path)
    before = [r for e in singles for r in _truth(e)]
    for e in singles:
        got = draco_orl.place(table, _truth(e), e.action_mask.numpy(), e.sequences.numpy())
        np.testing.assert_array_equal(got, _expected_on_actions(path, e))
    batches = _regroup(singles)
    after = [r for e in batches for r in _truth(e)]
    assert sorted(after) == sorted(before) and after != before  # OpenRLHF reordered the rows
    for e in batches:
        got = draco_orl.place(table, _truth(e), e.action_mask.numpy(), e.sequences.numpy(),
                              train_step=7)
        exp = _expected_on_actions(path, e)
        np.testing.assert_array_equal(got, exp)
        assert not np.any(got[~e.action_mask.numpy().astype(bool)])
    # The docs' old line, with no prompt offset: strict mode raises; cut and masked silently,
    # only part of the advantage mass stays on action tokens.
    e = batches[0]
    with pytest.raises(AlignmentError):
        table.batch(_truth(e), e.action_mask.numpy())
    naive = table.batch(_truth(e), e.action_mask.numpy(), strict=False)
    exp = _expected_on_actions(path, e)
    share = float(np.abs(naive * (naive == exp)).sum() / np.abs(exp).sum())
    print(f"\nOpenRLHF without the prompt offset: {share:.1%} of the advantage mass lands where "
          "it belongs")
    assert share < 0.9


def test_experience_maker_override(made):
    path, singles = made
    batches = _regroup(singles)
    cls = draco_orl.DracoExperienceMaker
    maker = cls.__new__(cls)  # its Ray actor groups are not needed for this method
    maker.draco_token_advantages = path
    maker.draco_id_key = draco_orl.ID_KEY
    maker.draco_ids_from_index = None
    out = maker.compute_advantages_and_returns(batches)
    for e in out:
        np.testing.assert_array_equal(e.advantages.numpy(), _expected_on_actions(path, e))
        assert torch.equal(e.returns, e.advantages)


def test_swapped_rows_and_wrong_step_are_refused(made):
    path, singles = made
    table = load_token_advantages(path)
    e = _regroup(singles)[0]
    ids = _truth(e)
    with pytest.raises(AlignmentError, match="trainer row 0"):
        draco_orl.place(table, [ids[1], ids[0], *ids[2:]], e.action_mask.numpy(),
                        e.sequences.numpy())
    with pytest.raises(AlignmentError, match="from train step 7, the row from step 8"):
        draco_orl.place(table, ids, e.action_mask.numpy(), e.sequences.numpy(), train_step=8)
