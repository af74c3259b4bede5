"""CREDO end to end on a resettable simulator, offline.

    python benchmarks/bench_credo.py [--seeds 300] [--batch 64] [--steps 5]

Each seed: sample a batch of rollouts from the chain simulator (examples/chain_env.py), give
every position a rubric-style prediction c_t (the true credit shrunk by 30% plus noise, so it
is informative but biased) and a predicted error e_t, plan replay with ``draco_cli.credo.allocation.plan``
(square-root allocation) or ``plan(..., allocation="uniform")`` (one p at the same expected
cost), run the two-sided replays
for the selected positions (K = 2 each side), correct with ``draco_cli.credo.correction.correct`` and form the policy
gradient estimate Σ g_t·Ĉ_t / batch. Over seeds it prints, per estimator, the bias against the
exact gradient (with a 99% confidence half-width), the variance (trace) and the mean replay
cost. Expected: corrected estimators unbiased within the bounds; square-root below uniform in
variance; no correction biased.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from chain_env import ChainEnv  # noqa: E402

from draco_cli.credo.allocation import plan  # noqa: E402
from draco_cli.credo.correction import correct  # noqa: E402

K = 2


def one_seed(env: ChainEnv, batch: int, seed: int, budget_share: float):
    rng = np.random.default_rng(seed)
    rows, scores, truths = [], {}, {}
    for i in range(batch):
        actions, _ = env.rollout(rng)
        for t in range(env.T):
            C = env.credit(actions, t)
            c = 0.7 * C + rng.normal(0, 0.05)
            before = sum(actions[:t])
            qr = env.value(t + 1, before + actions[t])
            qs = env.value(t, before)
            e = (qr * (1 - qr) + qs * (1 - qs)) / K + (C - c) ** 2  # the error head's job
            rid = f"r{i}"
            rows.append({"rollout_id": rid, "step": t + 1, "prediction": c, "error": e,
                         "n_steps": env.T,
                         "score_norm": float(np.linalg.norm(env.score(actions, t)))})
            scores[(rid, t + 1)] = env.score(actions, t)
            truths[(rid, t + 1)] = (actions, t)
    positions = pl.DataFrame(rows)
    T = env.T
    full_cost = float(sum(K * (2 * (T - r["step"]) + 1) for r in rows))
    budget = budget_share * full_cost
    out = {}
    sqrt_plan = plan(positions, budget, p_min=0.05, seed=seed, replays=K)
    uni_plan = plan(positions, budget, p_min=0.05, seed=seed + 10**6, replays=K,
                    allocation="uniform")
    for name, pl_df in (("square-root", sqrt_plan), ("uniform", uni_plan)):
        labels = []
        for r in pl_df.filter(pl.col("selected")).iter_rows(named=True):
            actions, t = truths[(r["rollout_id"], r["step"])]
            real, res = env.replay(actions, t, K, rng)
            labels += [{"rollout_id": r["rollout_id"], "step": r["step"], "side": "realized",
                        "sample": k, "return": v} for k, v in enumerate(real)]
            labels += [{"rollout_id": r["rollout_id"], "step": r["step"], "side": "resampled",
                        "sample": k, "return": v} for k, v in enumerate(res)]
        lab = pl.DataFrame(labels, schema={"rollout_id": pl.String, "step": pl.Int64,
                                           "side": pl.String, "sample": pl.Int64,
                                           "return": pl.Float64})
        credit, _ = correct(pl_df, lab)
        G = np.zeros(env.T)
        for r in credit.iter_rows(named=True):
            G += scores[(r["rollout_id"], r["step"])] * r["corrected"]
        cost = float(pl_df.filter(pl.col("selected"))
                      .select(pl.col("cost")).sum().item())
        out[f"corrected, {name}"] = (G / batch, cost)
    G = np.zeros(env.T)
    for r in positions.iter_rows(named=True):
        G += scores[(r["rollout_id"], r["step"])] * r["prediction"]
    # the no-correction control acquires the square-root plan's labels and ignores them: the
    # same replay budget, so the comparison does not confound the update with supervision
    out["no correction"] = (G / batch, out["corrected, square-root"][1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-share", type=float, default=0.3)
    args = ap.parse_args()
    env = ChainEnv(theta=np.linspace(-0.5, 1.0, args.steps))
    truth = env.gradient()
    results: dict[str, list] = {}
    costs: dict[str, list] = {}
    for s in range(args.seeds):
        for name, (g, c) in one_seed(env, args.batch, s, args.budget_share).items():
            results.setdefault(name, []).append(g)
            costs.setdefault(name, []).append(c)
    print(f"chain simulator: T={env.T}, batch {args.batch}, {args.seeds} seeds, K={K}, "
          f"budget {args.budget_share:.0%} of full replay")
    print(f"{'estimator':28s} {'max |bias|':>11s} {'99% half-width':>15s} {'bias/hw':>8s} "
          f"{'variance':>10s} {'mean cost':>10s}")
    var = {}
    for name, gs in results.items():
        G = np.array(gs)
        bias = G.mean(axis=0) - truth
        hw = 2.576 * G.std(axis=0, ddof=1) / np.sqrt(len(G))
        var[name] = float(G.var(axis=0, ddof=1).sum())
        worst = int(np.argmax(np.abs(bias) / np.maximum(hw, 1e-300)))
        print(f"{name:28s} {np.max(np.abs(bias)):11.5f} {hw[worst]:15.5f} "
              f"{abs(bias[worst]) / max(hw[worst], 1e-300):8.2f} {var[name]:10.6f} "
              f"{np.mean(costs[name]):10.1f}")
    ratio = var["corrected, square-root"] / var["corrected, uniform"]
    print(f"variance_ratio_sqrt_over_uniform={ratio:.3f}")


if __name__ == "__main__":
    main()
