"""Pieces for tests/trainers/test_verl_inloop.py that Ray workers import by name.

- ``FixedTokensAgentLoop`` (registered as ``draco_test_fixed``): a real verl ``AgentLoopBase``
  that returns fixed token ids instead of calling an inference server (no GPU here): its
  response ids, mask and reward follow from (uid, session_id) alone, after a random short
  sleep, so the sessions of a group finish in a different order on different workers.
- ``CpuWorker`` / ``CpuWorkerTQ``: draco's agent-loop workers, whose ``__init__`` sets the few
  attributes verl's own ``__init__`` would build from an HF model directory (tokenizer, rollout
  config); everything else — generate_sequences, _run_agent_loop, _agent_loop_postprocess,
  _postprocess, V1's _run_prompt and TransferQueue puts — is verl's code.
"""

from __future__ import annotations

import asyncio
import hashlib
import warnings

import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.rollout_trace import RolloutTraceConfig

from draco_cli.trainers.verl.hook import (
    DracoAgentLoopManager,
    DracoAgentLoopManagerTQ,
    DracoAgentLoopWorker,
    DracoAgentLoopWorkerTQ,
)
from tests.trainers.chatml import chatml_tokenizer

AGENT = "draco_test_fixed"
TWO_OUTPUTS = "two"  # a prompt whose session 1 returns two outputs (V1)
EQUAL_MASKS = "eq"  # a prompt whose sessions share one response mask (a swap only ids can tell)


def _rng(*key: object) -> np.random.Generator:
    digest = hashlib.sha256("|".join(map(str, key)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def session_tokens(uid: str, session: int, index: int = 0, equal_masks: bool = False
                   ) -> tuple[list[int], list[int], float]:
    """(response_ids, response_mask, reward) of a session's output ``index``."""
    mrng = _rng(uid) if equal_masks else _rng(uid, session, index, "mask")
    mask: list[int] = []
    for t in range(int(mrng.integers(2, 4))):
        mask += [1] * int(mrng.integers(2, 7))
        if t < 2:
            mask += [0] * int(mrng.integers(1, 4))
    rng = _rng(uid, session, index)
    ids = rng.integers(3, 300, len(mask)).tolist()
    return ids, mask, float(rng.integers(0, 2))


@register(AGENT)
class FixedTokensAgentLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        uid, session = str(kwargs["uid"]), int(kwargs["session_id"])
        await asyncio.sleep(float(_rng(uid, session, "t").uniform(0.0, 0.4)))
        equal = uid.startswith(EQUAL_MASKS)
        prompt = self.tokenizer.encode(str(kwargs["raw_prompt"][0]["content"]))
        n_out = 2 if uid.startswith(TWO_OUTPUTS) and session == 1 else 1
        outs = []
        for i in range(n_out):
            ids, mask, reward = session_tokens(uid, session, i, equal)
            outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=ids, response_mask=mask,
                                        reward_score=reward, num_turns=3,
                                        metrics=AgentLoopMetrics(),
                                        # V1 copies it to a session's earlier outputs
                                        extra_fields={"reward_extra_info": {}}))
        return outs if n_out > 1 else outs[0]


def _cpu_init(self, config, llm_client=None, teacher_client=None, reward_handles=None):
    self.config = config
    self.llm_client, self.teacher_client = llm_client, teacher_client
    self.reward_loop_worker_handles = reward_handles
    self.rollout_config = config.actor_rollout_ref.rollout
    self.dataset_cls = RLHFDataset
    self.tokenizer = chatml_tokenizer()
    self.processor = None
    self.hf_model_type = None
    self.mm_processor_kwargs = {}
    self.distillation_enabled = False
    self.tools = []
    RolloutTraceConfig.init("draco-test", "inloop", None, False, None)


class CpuWorker(DracoAgentLoopWorker):
    __init__ = _cpu_init


class CpuWorkerTQ(DracoAgentLoopWorkerTQ):
    def __init__(self, *args):
        import transfer_queue as tq

        _cpu_init(self, *args)
        tq.init()
        self.background_tasks = set()


class CpuManager(DracoAgentLoopManager):
    def __init__(self, *args, **kwargs):
        import ray

        self.agent_loop_workers_class = ray.remote(num_cpus=0)(CpuWorker)
        super().__init__(*args, **kwargs)


class CpuManagerTQ(DracoAgentLoopManagerTQ):
    def __init__(self, *args, **kwargs):
        import ray

        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(num_cpus=0)(CpuWorkerTQ)
