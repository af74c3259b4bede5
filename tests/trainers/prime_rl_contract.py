"""A contract stand-in for the part of prime-rl that draco's adapter touches, faithful to
PrimeIntellect-ai/prime-rl at commit 559b44772e471d1538537b8805cc77f3824a5e64 (prime-rl is not
on the package index and needs Python 3.12; the adapter was also run against that commit's own
code, see docs/decisions.md 2026-12-01). Written from reading, not copied:

- ``prime_rl.orchestrator.algo.base``: ``Algorithm(config, policy_pool)`` with ``action_loss_type
  = "rl"``, async ``setup``, ``score_group``, and ``finalize_group(episodes)`` awaiting
  ``score_group(episodes)``; ``iter_trainable_traces(episodes)`` yielding ``(episode, trace)``
  for traces with ``not trace.has_error and trace.agent.trainable`` and any node mask True.
- ``prime_rl.orchestrator.algo.routing.assign_advantages(trace, values)``: nodes with any mask
  True, in ``trace.nodes`` order; ``ValueError`` unless ``len(node.mask) == len(node.token_ids)``
  and ``len(values) == Σ sum(node.mask)``; then ``node.advantages`` = that node's slice.
- ``prime_rl.orchestrator.algo``: the closed ``ALGORITHM_CLASSES`` dict, and
  ``build_algorithm(config, policy_pool)`` looking ``config.type`` up in it at call time and
  asserting the class's ``action_loss_type`` equals the config's.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, ClassVar


class Algorithm:
    action_loss_type: ClassVar[str] = "rl"

    def __init__(self, config: Any, policy_pool: Any) -> None:
        self.policy_pool = policy_pool

    async def setup(self) -> None:
        pass

    async def score_group(self, episodes: list[Any]) -> None:
        pass

    async def finalize_group(self, episodes: list[Any]) -> None:
        await self.score_group(episodes)


def iter_trainable_traces(episodes: list[Any]):
    for episode in episodes:
        for trace in episode.traces:
            if trace.has_error or not trace.agent.trainable:
                continue
            if any(any(node.mask) for node in trace.nodes):
                yield episode, trace


def assign_advantages(trace: Any, values: float | list[float]) -> None:
    nodes = [node for node in trace.nodes if any(node.mask)]
    for node in nodes:
        if len(node.mask) != len(node.token_ids):
            raise ValueError("node masks must align with token ids")
    total = sum(sum(node.mask) for node in nodes)
    if isinstance(values, (int, float)):
        values = [float(values)] * total
    if len(values) != total:
        raise ValueError(f"advantages must align with trace {trace.id!r}'s sampled tokens: "
                         f"got {len(values)}, expected {total}")
    offset = 0
    for node in nodes:
        node.advantages = [float(v) for v in values[offset:offset + sum(node.mask)]]
        offset += sum(node.mask)


class GRPOAlgorithm(Algorithm):
    pass


class OPDAlgorithm(Algorithm):
    action_loss_type: ClassVar[str] = "ref_kl"


@dataclass
class AlgoConfig:
    type: str = "grpo"
    action_loss_type: str = "rl"


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the stand-in under prime-rl's module names for one test; the algo package."""
    classes: dict[str, type[Algorithm]] = {"grpo": GRPOAlgorithm, "opd": OPDAlgorithm}

    def build_algorithm(config: AlgoConfig, policy_pool: Any) -> Algorithm:
        cls = classes[config.type]
        assert cls.action_loss_type == config.action_loss_type
        return cls(config, policy_pool)

    mods = {name: types.ModuleType(name) for name in (
        "prime_rl", "prime_rl.orchestrator", "prime_rl.orchestrator.algo",
        "prime_rl.orchestrator.algo.base", "prime_rl.orchestrator.algo.routing")}
    base, routing = mods["prime_rl.orchestrator.algo.base"], mods[
        "prime_rl.orchestrator.algo.routing"]
    base.Algorithm, base.iter_trainable_traces = Algorithm, iter_trainable_traces  # type: ignore[attr-defined]
    routing.assign_advantages = assign_advantages  # type: ignore[attr-defined]
    algo = mods["prime_rl.orchestrator.algo"]
    algo.ALGORITHM_CLASSES, algo.build_algorithm = classes, build_algorithm  # type: ignore[attr-defined]
    algo.Algorithm = Algorithm  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return algo
