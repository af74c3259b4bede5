"""Where to replay (SPEC §6, Eq. 10): square-root allocation of inclusion probabilities under
a budget, the default replay cost, and the plan — Bernoulli selection with a recorded seed, the
predictions stored before any label exists."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from draco_cli.errors import InputError, UsageError

DEFAULT_REPLAYS = 2

@dataclass
class Allocation:
    p: np.ndarray
    lam: float
    spent: float  # Σ p_t ℓ_t
    slack: bool


def allocate(score_norm: np.ndarray, error: np.ndarray, cost: np.ndarray, budget: float,
             p_min: float = 0.05, tol: float = 1e-12) -> Allocation:
    """p_t = clip(‖g_t‖·sqrt(e_t/(λ ℓ_t)), p_min, 1) with Σ p_t ℓ_t ≤ budget: λ = 0 on a slack
    budget, else by bisection (docs/credo.md, "Allocation")."""
    g = np.asarray(score_norm, dtype=float)
    e = np.asarray(error, dtype=float)
    c = np.asarray(cost, dtype=float)
    if not 0 < p_min <= 1:
        raise UsageError("--p-min must be in (0, 1]")
    if np.any(c <= 0):
        raise InputError("cost must be > 0", field="cost")
    if np.any(e < 0):
        raise InputError("error must be >= 0", field="error")
    floor = p_min * c.sum()
    if budget < floor - 1e-9 * max(floor, 1):
        raise UsageError(f"budget {budget:g} is infeasible: every position needs p >= p_min, "
                         f"so the smallest feasible budget is {floor:.6g}")
    useful = (e * g) > 0
    slack_p = np.where(useful, 1.0, p_min)
    # Sums in another order round differently: a budget one rounding step under the slack or
    # the floor spend is that budget, not a case for the search (which could never meet it).
    rounding = 1e-12 * max(abs(budget), 1.0)
    if (slack_p * c).sum() <= budget + rounding:
        return Allocation(slack_p, 0.0, float((slack_p * c).sum()), True)
    min_p = np.full_like(c, p_min)
    if (min_p * c).sum() >= budget - rounding:
        # every position at p_min: the smallest λ that puts the last useful one there
        lam_floor = float(np.max(g[useful] ** 2 * e[useful] / (p_min**2 * c[useful])))
        return Allocation(min_p, lam_floor, float((min_p * c).sum()), False)

    def p_of(lam: float) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = g * np.sqrt(e / (lam * c))
        p: np.ndarray = np.clip(np.nan_to_num(raw, nan=0.0), p_min, 1.0)
        return p

    def spend(lam: float) -> float:
        return float((p_of(lam) * c).sum())

    lo, hi = 1e-12, 1.0
    while spend(hi) > budget:  # the spend falls as λ grows
        hi *= 4
    while spend(lo) < budget:
        lo /= 4
    for _ in range(400):
        mid = math.sqrt(lo * hi)
        if spend(mid) > budget:
            lo = mid
        else:
            hi = mid
        if hi / lo - 1 < tol:
            break
    p = p_of(hi)  # the side that respects the budget
    return Allocation(p, hi, float((p * c).sum()), False)


def default_cost(steps: np.ndarray, n_steps: np.ndarray, replays: int) -> np.ndarray:
    """K·(T − t + 1) + K·(T − t) environment actions (SPEC §6; docs/credo.md, "Positions")."""
    cost: np.ndarray = replays * (2.0 * (n_steps - steps) + 1.0)
    return cost


ALLOCATIONS = ("sqrt", "uniform")


def rollout_lengths(steps: pl.DataFrame) -> pl.DataFrame:
    """T per rollout from a steps table: its number of steps (rollout_id, n_steps)."""
    for col in ("rollout_id", "step"):
        if col not in steps.columns:
            raise InputError("missing column of the steps table", field=col)
    return steps.group_by("rollout_id").agg(pl.col("step").cast(pl.Int64).max()
                                            .alias("n_steps"))


def _with_cost(pos: pl.DataFrame, replays: int, n_steps: pl.DataFrame | None) -> pl.DataFrame:
    if "cost" in pos.columns:
        return pos
    if "n_steps" not in pos.columns:
        if n_steps is None:
            raise UsageError("the default replay cost needs each rollout's number of steps T: "
                             "pass the steps table (--steps), or give the positions an "
                             "n_steps or cost column (the largest listed step is not T when "
                             "only some steps are listed)")
        pos = pos.join(n_steps.select("rollout_id", pl.col("n_steps").cast(pl.Int64)),
                       on="rollout_id", how="left", maintain_order="left")
    idx = pos.with_row_index("__r")
    bad = idx.filter(pl.col("n_steps").is_null())
    if bad.height:
        raise InputError(f"rollout {bad['rollout_id'][0]!r} has no number of steps T (not in "
                         "the steps table)", row=int(bad["__r"][0]), field="n_steps")
    bad = idx.filter((pl.col("step") < 1) | (pl.col("step") > pl.col("n_steps")))
    if bad.height:
        r = bad.row(0, named=True)
        raise InputError(f"step {r['step']} is outside 1..T = 1..{r['n_steps']} of rollout "
                         f"{r['rollout_id']!r}", row=int(r["__r"]), field="step")
    return pos.with_columns(pl.Series("cost", default_cost(
        pos["step"].to_numpy(), pos["n_steps"].to_numpy(), replays)))


def plan(positions: pl.DataFrame, budget: float, *, p_min: float = 0.05, seed: int = 0,
         replays: int = DEFAULT_REPLAYS, head_version: str | None = None,
         n_steps: pl.DataFrame | None = None, allocation: str = "sqrt") -> pl.DataFrame:
    """The replay plan: positions plus p, selected, lambda, seed (and head_version).

    `allocation="uniform"` gives every position the same p at the expected cost the
    square-root plan spends under the same budget (the paper's uniform-replay arm)."""
    if allocation not in ALLOCATIONS:
        raise UsageError(f"--allocation takes sqrt or uniform, not {allocation!r}")
    if replays < 1:
        raise UsageError("--replays must be at least 1")
    if not (math.isfinite(budget) and budget > 0):
        raise UsageError(f"--budget {budget:g}: give a positive number of environment actions")
    for col in ("rollout_id", "step", "prediction", "error"):
        if col not in positions.columns:
            raise InputError("missing column of the positions table", field=col)
    if positions.height == 0:
        raise InputError("the positions table has no rows: nothing to plan", field="rollout_id")
    pos = positions.with_columns(pl.col("step").cast(pl.Int64))
    for col in ("prediction", "error"):
        bad = pos.with_row_index("__r").filter(pl.col(col).is_null() | pl.col(col).is_nan())
        if bad.height:
            raise InputError("must be a number", row=int(bad["__r"][0]), field=col)
    if pos.select(pl.struct("rollout_id", "step").is_duplicated().any()).item():
        raise InputError("duplicate (rollout_id, step)", field="step")
    if "score_norm" not in pos.columns:
        pos = pos.with_columns(pl.lit(1.0).alias("score_norm"))
    pos = _with_cost(pos, replays, n_steps)
    cost = pos["cost"].to_numpy()
    alloc = allocate(pos["score_norm"].to_numpy(), pos["error"].to_numpy(), cost, budget, p_min)
    if allocation == "uniform":
        p_uni = min(1.0, max(p_min, alloc.spent / float(cost.sum())))
        alloc = Allocation(np.full(pos.height, p_uni), 0.0, p_uni * float(cost.sum()),
                           alloc.slack)
    rng = np.random.default_rng(seed)
    selected = rng.random(pos.height) < alloc.p
    return pos.with_columns(
        pl.Series("p", alloc.p), pl.Series("selected", selected),
        pl.lit(alloc.lam).alias("lambda"), pl.lit(seed).alias("seed"),
        pl.lit(head_version).cast(pl.String).alias("head_version"),
        pl.lit(budget).alias("budget"), pl.lit(alloc.spent).alias("expected_cost"),
        pl.lit(allocation).alias("allocation"), pl.lit(replays).alias("replays"))
