"""A small resettable stochastic environment to run CREDO end to end offline.

Chain task of T binary decisions. The policy picks action 1 ("the right call") at step t with
probability σ(θ_t). The terminal evaluator succeeds with probability
base + gain·(fraction of right calls), so every decision matters a little. The state is
(t, right calls so far): restoring it is exact, which is what two-sided replay needs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np


@dataclass
class ChainEnv:
    theta: np.ndarray          # one logit per step
    base: float = 0.1
    gain: float = 0.8

    @property
    def T(self) -> int:
        return len(self.theta)

    def p_right(self, t: int) -> float:          # t is 0-based
        return 1 / (1 + math.exp(-self.theta[t]))

    def success_prob(self, right: int) -> float:
        return self.base + self.gain * right / self.T

    # -- sampling -------------------------------------------------------------------------

    def rollout(self, rng) -> tuple[list[int], float]:
        actions = [int(rng.random() < self.p_right(t)) for t in range(self.T)]
        return actions, float(rng.random() < self.success_prob(sum(actions)))

    def continue_from(self, t_next: int, right: int, rng) -> float:
        """Run from the state before decision ``t_next`` with ``right`` right calls so far."""
        for t in range(t_next, self.T):
            right += int(rng.random() < self.p_right(t))
        return float(rng.random() < self.success_prob(right))

    def replay(self, actions: list[int], t: int, K: int, rng) -> tuple[list[float], list[float]]:
        """Two-sided replay at decision t (0-based): realized side restores the state after
        it; resampled side restores the state before it and draws a fresh action."""
        before = sum(actions[:t])
        realized = [self.continue_from(t + 1, before + actions[t], rng) for _ in range(K)]
        resampled = [self.continue_from(t, before, rng) for _ in range(K)]
        return realized, resampled

    # -- exact quantities ------------------------------------------------------------------

    def value(self, t_next: int, right: int) -> float:
        """E[return] from the state before decision t_next (exact, by dynamic programming)."""
        if t_next == self.T:
            return self.success_prob(right)
        p = self.p_right(t_next)
        return p * self.value(t_next + 1, right + 1) + (1 - p) * self.value(t_next + 1, right)

    def credit(self, actions: list[int], t: int) -> float:
        before = sum(actions[:t])
        return self.value(t + 1, before + actions[t]) - self.value(t, before)

    def score(self, actions: list[int], t: int) -> np.ndarray:
        g = np.zeros(self.T)
        g[t] = actions[t] - self.p_right(t)
        return g

    def gradient(self) -> np.ndarray:
        """∇_θ E[return], exactly, by enumerating every action sequence."""
        g = np.zeros(self.T)
        for acts in itertools.product((0, 1), repeat=self.T):
            prob = math.prod(self.p_right(t) if a else 1 - self.p_right(t)
                             for t, a in enumerate(acts))
            r = self.success_prob(sum(acts))
            g += prob * r * sum(self.score(list(acts), t) for t in range(self.T))
        return g
