"""The exact finite-model check of CREDO's estimator (``draco replay exact-check``).

The model, its costs and why the paper's 0.1127514540 cannot be reproduced (the paper omits the
probabilities, policy and rewards that determine it): docs/credo.md, "Checks". Here the score is
g_t = a_t − π(1 | s_t) and the target C_t = E[R | realized state after step t] − V(s_t), so
E[Δ_t] = C_t with Δ_t the difference of the binomial side means (enumerated).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from draco_cli.credo.allocation import allocate

THETA = 0.25
W = 0.6                                   # how the observation shifts the second decision
RHO = (0.3, 0.7)                          # P(o1 = 1 | a1)
Q = {(0, 0, 0): 0.05, (0, 0, 1): 0.30, (0, 1, 0): 0.20, (0, 1, 1): 0.55,
     (1, 0, 0): 0.25, (1, 0, 1): 0.60, (1, 1, 0): 0.45, (1, 1, 1): 0.90}  # P(R = 1 | a1, o1, a2)
T = 2


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def p1(th: float) -> float:
    return sig(th)


def p2(o1: int, th: float) -> float:
    return sig(th + W * (2 * o1 - 1))


def bern(p: float, x: int) -> float:
    return p if x else 1 - p


def analytic_gradient(th: float = THETA) -> float:
    """∂J/∂θ by the score-function identity over the enumerated trajectories (exact)."""
    g = 0.0
    for a1, o1, a2 in itertools.product((0, 1), repeat=3):
        w = bern(p1(th), a1) * bern(RHO[a1], o1) * bern(p2(o1, th), a2) * Q[a1, o1, a2]
        g += w * ((a1 - p1(th)) + (a2 - p2(o1, th)))
    return g


@dataclass
class Position:
    prob: float          # P(trajectory)
    t: int
    score: float         # g_t
    q_real: float        # P(R = 1) on the realized side (state after step t restored)
    q_res: float         # P(R = 1) on the resampled side (fresh action at step t)
    cost: float          # additional environment actions of a replay of this position

    @property
    def credit(self) -> float:
        return self.q_real - self.q_res


# a number per position: a predictor's c_t, or an allocation's p_t
Predictor = Callable[[Position], float]

def trajectories(M: int, th: float = THETA) -> list[list[Position]]:
    """The 16 trajectories (a1, o1, a2, R), each with its two positions."""
    def cost(t: int) -> float:
        return M * (T - t + 1) + M * (T - t)

    def v2(a1: int, o1: int) -> float:   # E[R | state before decision 2]
        return sum(bern(p2(o1, th), b) * Q[a1, o1, b] for b in (0, 1))

    def q1(a1: int) -> float:            # E[R | a1], the observation resampled
        return sum(bern(RHO[a1], o) * v2(a1, o) for o in (0, 1))

    V1 = sum(bern(p1(th), a) * q1(a) for a in (0, 1))
    out = []
    for a1, o1, a2, R in itertools.product((0, 1), repeat=4):
        prob = bern(p1(th), a1) * bern(RHO[a1], o1) * bern(p2(o1, th), a2) * \
            bern(Q[a1, o1, a2], R)
        out.append([
            # realized side after step 1 keeps the realized observation o1
            Position(prob, 1, a1 - p1(th), v2(a1, o1), V1, cost(1)),
            Position(prob, 2, a2 - p2(o1, th), Q[a1, o1, a2], v2(a1, o1), cost(2)),
        ])
    return out


def delta_outcomes(pos: Position, M: int) -> list[tuple[float, float]]:
    """(probability, Δ) over every replay outcome: binomial side means."""
    out = []
    for i in range(M + 1):
        pi = math.comb(M, i) * pos.q_real ** i * (1 - pos.q_real) ** (M - i)
        for j in range(M + 1):
            pj = math.comb(M, j) * pos.q_res ** j * (1 - pos.q_res) ** (M - j)
            out.append((pi * pj, i / M - j / M))
    return out


def expected_sq_residual(pos: Position, c: float, M: int) -> float:
    """e_t = E[(Δ_t − c_t)²] = σ_t² + r_t², exactly."""
    return sum(pr * (d - c) ** 2 for pr, d in delta_outcomes(pos, M))


def estimator_moments(trajs: list[list[Position]], pred: Predictor, p_of: Predictor, M: int,
                      correct: bool) -> tuple[float, float, float]:
    """Exact (E[Ĝ], Var[Ĝ], E[replay cost]) of Ĝ = Σ_t g_t·Ĉ_t over trajectories, inclusion
    draws and replay outcomes. Uncorrected estimators acquire the same labels (same cost)."""
    mean = second = cost = 0.0
    for traj in trajs:
        per_pos: list[list[tuple[float, float, float]]] = []
        for pos in traj:
            c, p = pred(pos), p_of(pos)
            branches = [(1 - p, pos.score * c, 0.0)] if p < 1 else []
            for pr, d in delta_outcomes(pos, M):
                est = c + (d - c) / p if correct else c
                branches.append((p * pr, pos.score * est, pos.cost))
            per_pos.append(branches)
        for combo in itertools.product(*per_pos):
            pr = traj[0].prob * math.prod(b[0] for b in combo)
            val = sum(b[1] for b in combo)
            mean += pr * val
            second += pr * val * val
            cost += pr * sum(b[2] for b in combo)
    return mean, second - mean * mean, cost


def oracle_allocation(trajs: list[list[Position]], pred: Predictor, M: int, budget: float,
                      p_min: float) -> Predictor:
    """Eq. 10 with the exact e_t and |g_t|, expected cost Σ P(traj)·p_t·ℓ_t = budget, through
    the product allocator: weighting ℓ by P and ‖g‖ by sqrt(P) leaves p_t's formula unchanged
    and turns its budget into an expectation."""

    flat = [pos for traj in trajs for pos in traj]
    w = np.array([pos.prob for pos in flat])
    g = np.array([abs(pos.score) for pos in flat])
    e = np.array([expected_sq_residual(pos, pred(pos), M) for pos in flat])
    ell = np.array([pos.cost for pos in flat])
    a = allocate(g * np.sqrt(w), e, w * ell, budget, p_min)
    table = {id(pos): float(v) for pos, v in zip(flat, a.p)}
    return lambda pos: table[id(pos)]


def exact_check(M: int = 2, p_min: float = 0.05) -> list[dict[str, Any]]:
    """Rows per predictor × estimator: expectation, |error| against ∂J/∂θ, exact variance and
    expected replay cost per original trajectory (uniform and oracle at the same cost; the
    no-correction control buys the oracle plan's labels and ignores them)."""
    trajs = trajectories(M)
    truth = analytic_gradient()
    full_cost = sum(pos.prob * pos.cost for traj in trajs for pos in traj)
    budget = 0.5 * full_cost
    rows = []
    for name, pred in PREDICTORS.items():
        oracle = oracle_allocation(trajs, pred, M, budget, p_min)
        m, v, c = estimator_moments(trajs, pred, oracle, M, correct=False)
        rows.append(_row(f"no correction, {name} predictor", m, v, c, truth))
        oracle_row = _row(f"corrected, oracle square-root, {name} predictor",
                          *estimator_moments(trajs, pred, oracle, M, correct=True), truth)
        p_uni = oracle_row["expected_cost"] / full_cost
        m, v, c = estimator_moments(trajs, pred, lambda pos: p_uni, M,  # noqa: B023 - used in this iteration
                                    correct=True)
        rows.append(_row(f"corrected, uniform p={p_uni:.3f}, {name} predictor", m, v, c,
                         truth))
        rows.append(oracle_row)
    return rows


PREDICTORS: dict[str, Predictor] = {
    "zero": lambda pos: 0.0,                              # no rubric information
    "good": lambda pos: 0.8 * pos.credit,                 # close but shrunk: biased
    "bad": lambda pos: -0.5 * pos.credit + 0.2,           # wrong sign, offset
}


def _row(name: str, mean: float, var: float, cost: float, truth: float) -> dict[str, Any]:
    return {"estimator": name, "max_abs_error": abs(mean - truth), "variance": var,
            "expected_cost": cost, "expectation": mean, "gradient": truth}


def sweep_replays(Ms: Sequence[int] = (1, 2, 4), p_min: float = 0.05) -> list[dict[str, Any]]:
    """Replays per side M under one fixed expected budget (environment actions per original
    trajectory: half of full replay at M = 2, zero predictor): more replays per position buy less
    coverage. Exact variance of the corrected estimator with oracle allocation per M."""
    pred = PREDICTORS["zero"]
    truth = analytic_gradient()
    budget = 0.5 * sum(pos.prob * pos.cost for traj in trajectories(2) for pos in traj)
    rows = []
    for M in Ms:
        trajs = trajectories(M)
        full = sum(pos.prob * pos.cost for traj in trajs for pos in traj)
        b = min(budget, full)
        oracle = oracle_allocation(trajs, pred, M, b, p_min)
        m, v, c = estimator_moments(trajs, pred, oracle, M, correct=True)
        rows.append({**_row(f"corrected, oracle square-root, M={M}, zero predictor",
                            m, v, c, truth), "M": M})
    return rows
