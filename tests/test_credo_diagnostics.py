"""CREDO diagnostics: weight tails, the σ² vs (C − c)² split against exact values on the chain
simulator, allocator calibration, predictor drift, cost by category through `audit cost`."""

from __future__ import annotations

import sys

import numpy as np
import polars as pl
import pytest

from draco_cli.credo import Heads
from draco_cli.audit.cost import cost_categories
from draco_cli.credo.diagnostics import (allocator_calibration,
                                         predictor_drift, variance_split, weight_tails)
from tests.conftest import REPO, run_draco

sys.path.insert(0, str(REPO / "examples"))
from chain_env import ChainEnv  # noqa: E402


def test_weight_tails_by_hand():
    P = pl.DataFrame({"rollout_id": list("abcd"), "step": [1] * 4, "p": [0.5, 0.25, 1.0, 0.1],
                      "selected": [True, True, True, False]})
    t = weight_tails(P)
    w = np.array([2.0, 4.0, 1.0])
    assert t["replayed"] == 3 and t["max_weight"] == 4.0 and t["min_p"] == 0.1
    assert t["effective_sample_size"] == pytest.approx(w.sum() ** 2 / (w ** 2).sum())
    assert t["top_weight_share"] == pytest.approx(4 / 7)


def chain_batch(n=400, K=4, seed=0):
    """Every position replayed (p = 1) with K returns per side; exact σ², C and c known."""
    env = ChainEnv(theta=np.array([0.4, -0.2, 0.8]))
    rng = np.random.default_rng(seed)
    plan, labels, exact = [], [], []
    for i in range(n):
        acts, _ = env.rollout(rng)
        for t in range(env.T):
            before = sum(acts[:t])
            qr, qs = env.value(t + 1, before + acts[t]), env.value(t, before)
            C = qr - qs
            c = 0.5 * C + 0.05
            sigma2 = qr * (1 - qr) / K + qs * (1 - qs) / K
            plan.append({"rollout_id": f"r{i}", "step": t + 1, "p": 1.0, "selected": True,
                         "prediction": c, "error": sigma2 + (C - c) ** 2})
            real, res = env.replay(acts, t, K, rng)
            labels += [{"rollout_id": f"r{i}", "step": t + 1, "side": s, "sample": k,
                        "return": v} for s, vals in (("realized", real), ("resampled", res))
                       for k, v in enumerate(vals)]
            exact.append((sigma2, (C - c) ** 2))
    return pl.DataFrame(plan), pl.DataFrame(labels), np.array(exact)


def test_variance_split_matches_exact_noise_and_error():
    P, L, exact = chain_batch()
    v = variance_split(P, L)
    noise, err = exact.sum(axis=0)
    assert v["positions"] == P.height
    assert v["noise"] == pytest.approx(noise, rel=0.06)
    assert v["prediction_error"] == pytest.approx(err, rel=0.25, abs=2.0)
    assert 0 < v["noise_share"] < 1


def test_allocator_calibration_with_exact_errors():
    P, L, _ = chain_batch()
    cal = allocator_calibration(P, L, bins=4)
    assert cal["n"].sum() == P.height
    # exact e_t: the realized squared residual matches it on average in every bin
    for r in cal.iter_rows(named=True):
        assert r["mean_squared_residual"] == pytest.approx(r["mean_predicted_error"], rel=0.2)


def test_predictor_drift():
    F = pl.DataFrame({"rollout_id": ["a", "b", "c"], "step": [1, 1, 1], "x": [0.0, 1.0, 2.0]})
    old = Heads(["x"], [0.0, 1.0], [0.1, 0.0], 1.0, "heads-old", 3)
    new = Heads(["x"], [0.5, 1.0], [0.2, 0.0], 1.0, "heads-new", 3)
    d = predictor_drift(old, new, F)
    assert d["mean_abs_change"] == pytest.approx(0.5) and d["correlation"] == pytest.approx(1)
    assert (d["from"], d["to"]) == ("heads-old", "heads-new")
    assert d["mean_error_after"] == pytest.approx(0.2)


def test_cost_by_category_and_audit_cost(tmp_path):
    calls = pl.DataFrame({"phase": ["score", "score", "generate", "merge", "propose"],
                          "status": ["ok"] * 5, "input_tokens": [10, 20, 5, 5, 7],
                          "output_tokens": [1, 2, 1, 1, 3], "reasoning_tokens": [0, 4, 0, 0, 0],
                          "cost_usd": [0.1, 0.2, 0.05, 0.05, 0.01]})
    rollouts = pl.DataFrame({"rollout_id": ["a", "b"], "response_len": [100, 50]})
    steps = pl.DataFrame({"rollout_id": ["a", "a", "b"], "step": [1, 2, 1],
                          "n_tokens": [30, 40, 20]})
    rc = pl.DataFrame({"rollout_id": ["a"], "step": [1], "env_actions": [6], "tokens": [300],
                       "reconstruction_actions": [1], "reconstruction_tokens": [40],
                       "seconds": [0.1]})
    t = {r["category"]: r for r in cost_categories(calls, rollouts, steps, rc).to_dicts()}
    assert t["original"]["tokens"] == 150 and t["original"]["env_actions"] == 3
    assert t["replay"]["tokens"] == 300 and t["replay"]["env_actions"] == 6
    assert t["reconstruction"]["tokens"] == 40
    assert t["judge"]["tokens"] == 37 and t["judge"]["llm_calls"] == 2
    assert t["judge"]["cost_usd"] == pytest.approx(0.3)
    assert t["rubric writing"]["tokens"] == 12
    assert t["candidate scoring"]["tokens"] == 10
    res = run_draco("audit", "cost", "--calls", "sample_data/llm_calls.sqlite", "--rollouts",
                    "sample_data/appworld_mini/rollouts.parquet", "--steps",
                    "sample_data/appworld_mini/steps.parquet", "-o", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr.decode()
    cat = pl.read_parquet(tmp_path / "a" / "cost_category.parquet")
    assert {"original", "judge", "rubric writing"} <= set(cat["category"])
