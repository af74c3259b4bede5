"""draco_cli.trainers.openrlhf against OpenRLHF 0.11.2's own code on CPU.

Experiences are built by OpenRLHF's ``SamplesGenerator._process_response_into_experience`` from
agent outputs shaped as its ``utils/agent.py`` returns them (observation tokens, action ranges,
extra_logs), then regrouped by its ``RemoteExperienceMaker.split_rollout_samples`` with dynamic
batching (length-balanced partitions: rows change order and padding). DeepSpeed, vLLM and
flash-attn cannot install on CPU; ``stubs`` stands in for them at import time only.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests.trainers import stubs
from tests.trainers.draco_files import Rollout, draco_token_file, expected_rows

pytestmark = pytest.mark.trainers
torch = pytest.importorskip("torch", reason="needs the trainers extra (torch)")
pytest.importorskip("openrlhf", reason="needs the trainers extra (OpenRLHF 0.11.2)")
with stubs.installed():
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ppo_utils import samples_generator as orl_samples
    from openrlhf.trainer.ppo_utils.experience import (
        balance_experiences,
        make_experience_batch,
        remove_padding_in_sequences,
        split_experience_batch,
    )
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
    from openrlhf.utils.agent import AgentInstanceBase

    from draco_cli.trainers import openrlhf as draco_orl

    _ = draco_orl.DracoExperienceMaker  # built now, while OpenRLHF's imports resolve
    _ = draco_orl.DracoAgentExecutor
from draco_cli.errors import InputError
from draco_cli.inloop import BlockingStepScorer, TrainerRollout
from draco_cli.trainers.loader import AlignmentError, load_token_advantages
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted

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


# ── Scoring inside the step: OpenRLHF's own executor, generator and builder on CPU ──
#
# Rollouts come from OpenRLHF's ``RolloutRayActor.generate_responses`` (its method, run on a
# stand-in for vLLM that returns random tokens up to the sampling budget) driving our
# ``DracoAgentExecutor`` (OpenRLHF's ``MultiTurnAgentExecutor``), collected by its
# ``SamplesGenerator.generate_samples`` / ``_generate_vllm`` (Ray calls answered in-process,
# the last dispatched prompt finishing first, so samples arrive out of prompt order) and built
# into experiences by its ``_process_response_into_experience``. The experience maker runs
# OpenRLHF's ``make_experience_batch`` and ``split_rollout_samples`` (dynamic batching); only
# ``make_experience`` (the model forwards on Ray actor groups, which neither read nor write
# advantages) is skipped. Then ``balance_experiences`` and the replay buffer's split/collate.

N, PROMPTS, INLOOP_LEN, LONG = 4, 3, 160, 5   # the 6th rollout's feedback overflows max_len
ACTOR = RolloutRayActor.__ray_actor_class__


class _Agent(AgentInstanceBase):
    """1–3 turns of tool feedback; records what ``agent_tokens()`` shows it at each step."""

    made = itertools.count()
    seen: dict[str, dict] = {}

    def __init__(self, *args, **kwargs):
        self.k, self.turn = next(_Agent.made), 0

    async def step(self, states, **kwargs):
        t = draco_orl.agent_tokens()
        self.turn += 1
        long = self.k == LONG
        done = not long and self.turn >= 1 + self.k % 3
        feedback = "error " * 200 if long else ("" if done else f" tool says ok {self.turn}.")
        reward = float(self.k % 2) if done else (0.5 if long else 0.0)
        _Agent.seen[str(t.rollout_id)] = {
            "label": states["label"], "prompt_ids": list(t.prompt_ids),
            "response_ids": list(t.response_ids), "mask": list(t.response_mask),
            "feedback": feedback, "reward": reward + _Agent.seen.get(
                str(t.rollout_id), {}).get("reward", 0.0)}
        return {"rewards": torch.tensor(reward), "scores": torch.tensor(reward),
                "environment_feedback": feedback, "done": done, "extra_logs": {"turn": self.turn}}


class _Vllm:
    """vLLM's place in OpenRLHF's RolloutRayActor: random tokens up to ``max_tokens``."""

    def __init__(self, tok, seed):
        self.tok, self.rng = tok, np.random.default_rng(seed)
        self.executor = _Executor()

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        want = int(self.rng.integers(3, 12))
        n = min(want, sampling_params.max_tokens)
        ids = self.rng.integers(3, 320, n).tolist()
        await asyncio.sleep(0)          # the group's rollouts interleave
        out = SimpleNamespace(token_ids=ids, text=self.tok.decode(ids), logprobs=None,
                              finish_reason="length" if n < want else "stop")
        return SimpleNamespace(outputs=[out])


class _Executor(draco_orl.DracoAgentExecutor):   # what the agent file defines
    def __init__(self):
        super().__init__(_Agent)


class _Remote:
    """A Ray actor handle answered in-process: ``.remote(...)`` runs OpenRLHF's method."""

    def __init__(self, actor):
        self.generate_responses = SimpleNamespace(
            remote=lambda **kw: asyncio.run(ACTOR.generate_responses(actor, **kw)))
        self.get_num_unfinished_requests = SimpleNamespace(remote=lambda: 0)


def _args():
    return SimpleNamespace(
        rollout=SimpleNamespace(batch_size=PROMPTS, n_samples_per_prompt=N,
                                max_tokens_per_gpu=300, micro_batch_size=4),
        vllm=SimpleNamespace(enable_sleep=False),
        algo=SimpleNamespace(dynamic_filtering_enable=False,
                             advantage=SimpleNamespace(is_correction_level="off",
                                                       estimator="group_norm")),
        train=SimpleNamespace(dynamic_batch_enable=True),
        actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=2),
        ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1))


def _generate(generator_class=SamplesGenerator):
    """One step's samples from OpenRLHF's generator (or a subclass), and what each agent saw."""
    from tests.trainers.chatml import chatml_tokenizer

    tok = chatml_tokenizer()
    _Agent.seen.clear()
    _Agent.made = itertools.count()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Book flight {p}."}],
                                       tokenize=False, add_generation_prompt=True)
               for p in range(PROMPTS)]
    loader = [(None, prompts, [f"task{p}" for p in range(PROMPTS)], [None] * PROMPTS)]
    gen = generator_class(SimpleNamespace(args=_args()), loader, None, tok,
                          [_Remote(_Vllm(tok, 1)), _Remote(_Vllm(tok, 2))])
    mp = pytest.MonkeyPatch()
    mp.setattr(orl_samples, "SamplingParams", lambda **kw: SimpleNamespace(**kw))
    mp.setattr(orl_samples, "ray", SimpleNamespace(
        get=lambda ref: ref, wait=lambda refs, num_returns=1, timeout=None: (refs[-1:],
                                                                             refs[:-1])))
    try:
        samples, _, _, _ = gen.generate_samples(max_len=INLOOP_LEN, n_samples_per_prompt=N)
    finally:
        mp.undo()
    return tok, samples, dict(_Agent.seen)


@pytest.fixture(scope="module")
def generated():
    return _generate()


def _maker(tok, **draco):
    strategy = SimpleNamespace(args=_args())
    maker = draco_orl.DracoExperienceMaker(None, None, None, None, None, strategy, tok, **draco)
    maker.make_experience = lambda samples_list: samples_list   # the model forwards
    return maker


def _expected_rollouts(tok, samples, seen):
    """The step as the agents saw it (their token ids, cut at max_len), in OpenRLHF's order."""
    ids = [str(int(s.info[draco_orl.ID_KEY][0])) for s in samples]
    out = []
    for i, rid in enumerate(ids):
        a = seen[rid]
        fb = tok(text=a["feedback"], add_special_tokens=False)["input_ids"]
        keep = INLOOP_LEN - len(a["prompt_ids"])
        out.append(TrainerRollout(rid, f"1/{i // N}", tok.decode(a["prompt_ids"]),
                                  (a["response_ids"] + fb)[:keep], (a["mask"] + [0] * len(fb))[:keep],
                                  outcome=a["reward"], train_step=1, row=i))
    return out


@pytest.fixture
def judge(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def _values_by_row(experiences):
    """rollout id -> the values on its action columns from its first action token."""
    out = {}
    for e in experiences:
        for b, rid in enumerate(draco_orl.experience_rollout_ids(e)):
            m = e.action_mask[b].numpy().astype(bool)
            c = int(np.argmax(m))
            n = int(e.attention_mask[b].sum()) - 1 - c
            adv = e.advantages[b].numpy()
            assert not adv[~m].any() and not adv[c + n:].any()
            out[rid] = adv[c: c + n]
    return out


def test_scored_in_the_step_exact_through_regrouping(generated, judge, tmp_path):
    tok, samples, seen = generated
    ids = [str(int(s.info[draco_orl.ID_KEY][0])) for s in samples]
    assert sorted(ids) == sorted(seen) and len(ids) == N * PROMPTS   # the id rode the last step
    labels = [seen[r]["label"] for r in ids]
    assert all(len(set(labels[g * N:(g + 1) * N])) == 1 for g in range(PROMPTS))
    assert labels[0] == f"task{PROMPTS - 1}"         # arrival order, not prompt order
    cut = [r for r in ids if len(seen[r]["prompt_ids"]) + len(seen[r]["response_ids"])
           + len(tok(text=seen[r]["feedback"])["input_ids"]) > INLOOP_LEN]
    assert len(cut) == 1 and bool(samples[ids.index(cut[0])].info["response_clip_ratio"][0])

    url = judge.url + "/v1"
    maker = _maker(tok, judge={"model": "openai/m", "base_url": url,
                               "call_log": tmp_path / "a.sqlite"}, audit_dir=tmp_path / "steps")
    # the rows draco builds, before and after OpenRLHF's regrouping, are the same rollouts
    before = draco_orl.experience_rollouts(samples, n_samples_per_prompt=N, decode=tok.decode,
                                           train_step=1)
    after = draco_orl.experience_rollouts(maker.split_rollout_samples(samples),
                                          n_samples_per_prompt=N, decode=tok.decode, train_step=1)
    want = _expected_rollouts(tok, samples, seen)
    for x, y, w in zip(before, after, want):
        assert (x.rollout_id, x.group_id, x.instruction, x.outcome) == \
            (y.rollout_id, y.group_id, y.instruction, y.outcome) == \
            (w.rollout_id, w.group_id, w.instruction, w.outcome)
        for got in (x, y):
            np.testing.assert_array_equal(got.response_ids, w.response_ids)
            np.testing.assert_array_equal(got.response_mask, w.response_mask)
    try:
        experiences = maker.make_experience_batch(samples)
    finally:
        maker.draco_close()
    order = [i for e in experiences for i in e.index]
    assert len(experiences) > 1 and order != sorted(order)     # rows regrouped
    result = maker.draco_judge.last
    with BlockingStepScorer("openai/m", base_url=url, group_size=N, decode=tok.decode,
                            call_log=tmp_path / "b.sqlite") as s:
        own = s.score_step(want, 1)       # the StepScorer on the agents' own view
    assert not own.fallbacks and set(own.rows) == set(ids)
    # exact on every row: after split_rollout_samples, after dynamic batching across ranks,
    # and in the replay buffer's collated micro-batches
    balanced = balance_experiences(experiences, _args())
    items = [i for e in balanced for i in remove_padding_in_sequences(split_experience_batch(e))]
    collated = [make_experience_batch(items[k:k + 3]) for k in range(0, len(items), 3)]
    for batch in (experiences, balanced, collated):
        got = _values_by_row(batch)
        assert set(got) == set(ids)
        for rid in ids:
            np.testing.assert_array_equal(got[rid], own.rows[rid].values)
    assert sum(bool(v.values.any()) for v in own.rows.values()) > N
    trunc = own.rows[cut[0]].values
    assert len(trunc) == INLOOP_LEN - len(seen[cut[0]]["prompt_ids"])  # the tokens it has
    # the step's metrics ride in info, one value per row: OpenRLHF's actor averages them
    con = sqlite3.connect(tmp_path / "a.sqlite")
    paid = con.execute("select count(*) from calls").fetchone()[0]
    con.close()
    assert result.metrics["draco/judge_calls"] == paid > 0
    for batch in (experiences, collated):
        for key, value in {**result.metrics, "draco/truncated_rollouts": 1.0}.items():
            rows = torch.cat([torch.as_tensor(e.info[key], dtype=torch.float32).reshape(-1)
                              for e in batch])
            assert rows.numel() == N * PROMPTS and torch.all(rows == np.float32(value)), key
    assert (tmp_path / "steps" / "step-000001" / "metrics.json").exists()


def test_deadline_fallback_is_counted(generated, monkeypatch, tmp_path):
    tok, samples, _ = generated
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    slow = FakeLLMServer(answer=scripted, latency=2).start()
    try:
        settings = {"base_url": slow.url + "/v1", "deadline": 0.3, "request_deadline": 30,
                    "fallback": "outcome"}
        maker = _maker(tok, judge={"model": "openai/m", "call_log": tmp_path / "a.sqlite",
                                   **settings})
        try:
            experiences = maker.make_experience_batch(samples)
        finally:
            maker.draco_close()
        want = _expected_rollouts(tok, samples, _Agent.seen)
        with BlockingStepScorer("openai/m", group_size=N, decode=tok.decode,
                                call_log=tmp_path / "b.sqlite", **settings) as s:
            own = s.score_step(want, 1)
    finally:
        slow.stop()
    assert len(own.fallbacks) == PROMPTS
    got = _values_by_row(experiences)
    for r in want:
        np.testing.assert_array_equal(got[r.rollout_id], own.rows[r.rollout_id].values)
        assert own.rows[r.rollout_id].source == "fallback:outcome"
    assert any(v.any() for v in got.values())       # outcome GRPO, not silence
    info = experiences[0].info
    assert float(info["draco/fallback_groups"][0]) == PROMPTS
    assert float(info["draco/fallback_rollouts"][0]) == N * PROMPTS


def test_agent_tokens_outside_a_rollout_is_a_usage_error():
    from draco_cli.errors import UsageError

    with pytest.raises(UsageError, match="no rollout is running"):
        draco_orl.agent_tokens()


def test_install_makes_openrlhfs_trainer_build_the_draco_maker(generated, monkeypatch):
    tok = generated[0]
    monkeypatch.setattr(ppo_trainer, "RemoteExperienceMaker", RemoteExperienceMaker)
    monkeypatch.setattr(ppo_trainer, "SamplesGenerator", SamplesGenerator)
    settings = {"model": "openai/m", "call_log": "calls.sqlite", "deadline": 60}
    cls = draco_orl.install(judge=settings, keep=3)
    assert ppo_trainer.RemoteExperienceMaker is cls
    assert ppo_trainer.SamplesGenerator is draco_orl.DracoSamplesGenerator   # groups early
    # as BasePPOTrainer.__init__ calls it
    maker = ppo_trainer.RemoteExperienceMaker(None, None, None, None, None,
                                              SimpleNamespace(args=_args()), tok)
    assert isinstance(maker, draco_orl.DracoExperienceMaker)
    assert maker.draco_judge.judge == settings and maker.draco_judge.keep == 3
    assert maker.draco_judge.group_size == N and maker.draco_judge.scorer is None  # lazy
    maker.draco_close()
    from draco_cli.errors import UsageError

    with pytest.raises(UsageError, match="judge=... or token_advantages="):
        draco_orl.install()


def test_groups_are_judged_as_the_generator_builds_them(judge, tmp_path):
    """``DracoSamplesGenerator`` (what ``install(judge=...)`` makes OpenRLHF's trainer build)
    hands each prompt's samples to the maker's judge as ``_generate_vllm`` builds them: the
    judge is asked before the maker has the step, nothing is asked twice, and every row gets
    the values the maker would give the same samples without it."""
    from draco_cli.trainers.openrlhf import DracoSamplesGenerator
    from tests.trainers.chatml import chatml_tokenizer

    url = judge.url + "/v1"
    early = _maker(chatml_tokenizer(), judge={"model": "openai/m", "base_url": url,
                                              "call_log": tmp_path / "a.sqlite"})
    try:
        tok, samples, _ = _generate(DracoSamplesGenerator)
        assert len(early.draco_judge.early) == N * PROMPTS   # every group handed over
        deadline = time.monotonic() + 10
        while judge.hits["chat"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert judge.hits["chat"] > 0        # judging began before the maker had the step
        got = _values_by_row(early.make_experience_batch(samples))
    finally:
        early.draco_close()
    plain = _maker(tok, judge={"model": "openai/m", "base_url": url,
                               "call_log": tmp_path / "b.sqlite"})
    try:
        want = _values_by_row(plain.make_experience_batch(samples))
    finally:
        plain.draco_close()
    assert set(got) == set(want) and len(got) == N * PROMPTS
    for rid in want:
        np.testing.assert_array_equal(got[rid], want[rid])
    assert any(v.any() for v in want.values())
    logged = []
    for log in ("a", "b"):
        con = sqlite3.connect(tmp_path / f"{log}.sqlite")
        logged.append(sorted(con.execute("select request_hash, sample from calls").fetchall()))
        con.close()
    assert logged[0] == logged[1]            # the same requests, each asked once
    assert early.draco_judge.last.metrics["draco/rollouts"] == N * PROMPTS


def test_samples_that_are_not_the_generated_batch_are_refused(judge, tmp_path):
    from draco_cli.trainers.openrlhf import DracoSamplesGenerator
    from tests.trainers.chatml import chatml_tokenizer

    maker = _maker(chatml_tokenizer(), judge={"model": "openai/m", "base_url": judge.url + "/v1",
                                              "call_log": tmp_path / "a.sqlite"})
    try:
        _, samples, _ = _generate(DracoSamplesGenerator)
        with pytest.raises(InputError, match="not the ones generated, in the order generated"):
            maker.make_experience_batch(samples[N:] + samples[:N])   # groups moved
    finally:
        maker.draco_close()


def test_with_two_makers_open_the_generator_hands_nothing_over(judge, tmp_path):
    """Which trainer's samples a generator builds cannot be told with two makers in one
    process: each maker then judges its own step from make_experience_batch."""
    from draco_cli.trainers.openrlhf import DracoSamplesGenerator
    from tests.trainers.chatml import chatml_tokenizer

    url = judge.url + "/v1"
    a, b = (_maker(chatml_tokenizer(), judge={"model": "openai/m", "base_url": url,
                                              "call_log": tmp_path / f"{k}.sqlite"})
            for k in "ab")
    try:
        _, samples, _ = _generate(DracoSamplesGenerator)
        assert a.draco_judge.early is None and b.draco_judge.early is None
        assert judge.hits["chat"] == 0
        values = _values_by_row(a.make_experience_batch(samples))
        assert len(values) == N * PROMPTS and a.draco_judge.last.metrics["draco/rollouts"] \
            == N * PROMPTS
    finally:
        a.draco_close()
        b.draco_close()


def test_a_generation_that_fails_part_way_leaves_nothing_behind(judge, tmp_path, monkeypatch):
    """Groups handed over before generation raised are forgotten: the step, generated again,
    is judged whole and right."""
    from draco_cli.trainers.openrlhf import DracoSamplesGenerator
    from tests.trainers.chatml import chatml_tokenizer

    built = {"n": 0}
    real = DracoSamplesGenerator._process_response_into_experience

    def flaky(self, response, **kw):
        built["n"] += 1
        if built["n"] == N + 1:          # the second prompt's first sample: an engine error
            raise RuntimeError("engine died")
        return real(self, response, **kw)

    maker = _maker(chatml_tokenizer(), judge={"model": "openai/m", "base_url": judge.url + "/v1",
                                              "call_log": tmp_path / "a.sqlite"})
    try:
        monkeypatch.setattr(DracoSamplesGenerator, "_process_response_into_experience", flaky)
        with pytest.raises(RuntimeError, match="engine died"):
            _generate(DracoSamplesGenerator)
        assert maker.draco_judge.early is None
        monkeypatch.setattr(DracoSamplesGenerator, "_process_response_into_experience", real)
        _, samples, _ = _generate(DracoSamplesGenerator)
        got = _values_by_row(maker.make_experience_batch(samples))
        assert len(got) == N * PROMPTS and maker.draco_judge.last.metrics["draco/rollouts"] \
            == N * PROMPTS
    finally:
        maker.draco_close()
