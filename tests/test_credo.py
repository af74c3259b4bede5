"""CREDO: allocation (KKT), correction, exact unbiasedness, heads, evolution, malformed input."""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.credo import allocate, correct, fit_heads, plan, weighted_ridge
from draco_cli.credo.exact_check import exact_check
from draco_cli.errors import InputError, UsageError
from tests.conftest import examples, run_draco


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(2, 40), st.integers(0, 10**6), st.floats(0.05, 0.95))
def test_allocation_kkt(n, seed, share):
    rng = np.random.default_rng(seed)
    g = rng.uniform(0.1, 3, n)
    e = rng.uniform(0, 2, n) * (rng.random(n) > 0.1)
    ell = rng.uniform(1, 20, n)
    p_min = 0.05
    floor = p_min * ell.sum()
    slack = np.where(e * g > 0, 1.0, p_min) @ ell
    budget = floor + share * (slack - floor)
    a = allocate(g, e, ell, budget, p_min)
    assert (a.p >= p_min - 1e-12).all() and (a.p <= 1 + 1e-12).all()
    if a.slack:
        assert a.lam == 0 and a.spent <= budget * (1 + 1e-12)
        return
    assert a.spent == pytest.approx(budget, rel=1e-8)           # budget met
    raw = g * np.sqrt(e / (a.lam * ell))
    interior = (a.p > p_min + 1e-9) & (a.p < 1 - 1e-9)
    np.testing.assert_allclose(a.p[interior], raw[interior], rtol=1e-6)  # p ∝ g·sqrt(e/ℓ)
    assert (raw[a.p >= 1 - 1e-9] >= 1 - 1e-6).all()           # clipped at 1 only if above
    assert (raw[a.p <= p_min + 1e-9] <= p_min + 1e-6).all()   # clipped at p_min only if below


@pytest.mark.parametrize("e", [[0.0, 0.0], [0.0, 1.5]])
def test_allocation_ends_at_a_budget_one_rounding_step_from_the_floor(e):
    # a draw test_allocation_kkt can make: no useful position, budget = floor + 0.5·0, summed
    # in another order; the search for λ used to run forever on it
    ell, p_min = np.random.default_rng(1).uniform(1, 20, 2), 0.05
    g = np.array([0.3, 2.7])
    floor = p_min * ell.sum()
    budget = floor + 0.5 * (np.full(2, p_min) @ ell - floor)  # as test_allocation_kkt makes it
    assert budget < (np.full(2, p_min) * ell).sum()  # one rounding step under the floor spend
    for budget in (budget, np.nextafter(budget, 0), floor):
        a = allocate(g, np.array(e), ell, budget, p_min)
        assert (a.p == p_min).all() and np.isfinite(a.lam)
        assert a.spent == pytest.approx(budget, rel=1e-12)


def test_slack_budget_is_left_unspent_and_infeasible_budget_is_an_error():
    g, e, ell = np.ones(3), np.array([1.0, 0.0, 2.0]), np.array([4.0, 4.0, 2.0])
    a = allocate(g, e, ell, 100.0, 0.1)
    assert a.slack and a.lam == 0 and a.p.tolist() == [1.0, 0.1, 1.0] and a.spent < 100
    with pytest.raises(UsageError, match=r"smallest feasible budget is 1\b"):
        allocate(g, e, ell, 0.5, 0.1)


def positions(n_rollouts=6, T=4, seed=0):
    rng = np.random.default_rng(seed)
    return pl.DataFrame([{"rollout_id": f"r{i}", "step": t, "prediction": float(rng.normal()),
                          "error": float(rng.uniform(0.1, 1)), "n_steps": T}
                         for i in range(n_rollouts) for t in range(1, T + 1)])


def test_plan_defaults_seed_and_columns():
    p1 = plan(positions(), budget=60, seed=3, replays=2)
    p2 = plan(positions(), budget=60, seed=3, replays=2)
    assert p1.equals(p2)
    # K(T − t + 1) resampled + K(T − t) realized actions
    assert p1.filter(pl.col("step") == 1)["cost"][0] == 2 * 4 + 2 * 3
    assert p1.filter(pl.col("step") == 4)["cost"][0] == 2 * 1 + 2 * 0
    assert {"p", "selected", "lambda", "seed", "prediction", "error"} <= set(p1.columns)
    assert p1["expected_cost"][0] == pytest.approx(60, rel=1e-8)
    assert not plan(positions(), budget=60, seed=4)["selected"].equals(p1["selected"])


def test_correction_by_hand():
    P = pl.DataFrame({"rollout_id": ["a", "a", "b"], "step": [1, 2, 1],
                      "prediction": [0.2, -0.1, 0.5], "p": [0.5, 0.25, 1.0],
                      "selected": [True, False, True]})
    L = pl.DataFrame({"rollout_id": ["a"] * 4 + ["b"] * 2 + ["a"] * 2,
                      "step": [1, 1, 1, 1, 1, 1, 2, 2],
                      "side": ["realized", "realized", "resampled", "resampled", "realized",
                               "resampled", "realized", "resampled"],
                      "sample": [0, 1, 0, 1, 0, 0, 0, 0],
                      "return": [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]})
    out, info = correct(P, L)
    got = dict(zip(zip(out["rollout_id"], out["step"]), out["corrected"]))
    assert got[("a", 1)] == pytest.approx(0.2 + (0.5 - 0.2) / 0.5)   # Δ = 1 − 0.5
    assert got[("a", 2)] == -0.1                                     # not selected: c_t
    assert got[("b", 1)] == pytest.approx(0.5 + (-1.0 - 0.5) / 1.0)
    assert info["labels_ignored"] == 2                              # labels of (a, 2)
    nc, _ = correct(P, L, no_correction=True)
    assert nc["corrected"].to_list() == [0.2, -0.1, 0.5]
    R = pl.DataFrame({"rollout_id": ["a", "b"], "group_id": ["g", "g"], "outcome": [1.0, 0.0]})
    mixed, _ = correct(P, L, beta=0.25, rollouts=R)
    a1 = mixed.filter((pl.col("rollout_id") == "a") & (pl.col("step") == 1))["advantage"][0]
    assert a1 == pytest.approx(0.25 * 1.0 + 0.75 * got[("a", 1)])  # RLOO of a = 1 − 0
    with pytest.raises(InputError, match=r"selected position \('b', step 1\) has no resampled"):
        correct(P, L.filter(~((pl.col("rollout_id") == "b") & (pl.col("side") == "resampled"))))
    with pytest.raises(InputError, match="side must be realized or resampled"):
        correct(P, L.with_columns(pl.lit("other").alias("side")))
    with pytest.raises(InputError, match="field 'return'"):
        correct(P, L.drop("return"))


def test_unbiased_by_exact_enumeration_and_sqrt_beats_uniform():
    from draco_cli.credo import exact_check as ex

    trajs = ex.trajectories(2)
    assert len(trajs) == 16 and sum(t[0].prob for t in trajs) == pytest.approx(1, abs=1e-15)
    h = 1e-5  # the analytic gradient against a central finite difference of J

    def J(th):
        return sum(ex.bern(ex.p1(th), a1) * ex.bern(ex.RHO[a1], o1) * ex.bern(ex.p2(o1, th), a2)
                   * ex.Q[a1, o1, a2] for a1, o1, a2 in itertools.product((0, 1), repeat=3))

    assert ex.analytic_gradient() == pytest.approx((J(ex.THETA + h) - J(ex.THETA - h))
                                                   / (2 * h), abs=1e-9)
    # E[Δ_t] = C_t and Σ_t E[g_t C_t] = ∇J, independently of any estimator
    assert sum(p.prob * p.score * p.credit for t in trajs for p in t) == \
        pytest.approx(ex.analytic_gradient(), abs=1e-15)
    rows = {r["estimator"]: r for r in exact_check(M=2)}
    for name, r in rows.items():
        if name.startswith("corrected"):
            assert r["max_abs_error"] < 1e-9, name
    assert rows["no correction, bad predictor"]["max_abs_error"] > 0.05
    for pred in ("zero", "good", "bad"):
        u = next(r for n, r in rows.items() if n.startswith("corrected, uniform")
                 and n.endswith(f"{pred} predictor"))
        s = rows[f"corrected, oracle square-root, {pred} predictor"]
        nc = rows[f"no correction, {pred} predictor"]
        assert s["expected_cost"] == pytest.approx(u["expected_cost"], rel=1e-9)
        assert nc["expected_cost"] == pytest.approx(s["expected_cost"], rel=1e-9)  # same labels
        assert s["variance"] < u["variance"]
    assert rows["corrected, oracle square-root, bad predictor"]["variance"] > \
        rows["corrected, oracle square-root, good predictor"]["variance"]


def test_weighted_ridge_matches_numpy_least_squares():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 3))
    y = X @ [1.0, -2.0, 0.5] + 0.3 + rng.normal(0, 0.1, 50)
    w = rng.uniform(0.5, 4, 50)
    beta = weighted_ridge(X, y, w, ridge=0.0)
    A = np.column_stack([np.ones(50), X]) * np.sqrt(w)[:, None]
    ref, *_ = np.linalg.lstsq(A, y * np.sqrt(w), rcond=None)
    np.testing.assert_allclose(beta, ref, rtol=1e-9)


def simulated(n=60, seed=0):
    """A plan and labels from the chain simulator, with informative features."""
    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    from chain_env import ChainEnv

    env = ChainEnv(theta=np.array([0.2, -0.3, 0.5]))
    rng = np.random.default_rng(seed)
    pos, feats, truth = [], [], {}
    for i in range(n):
        acts, _ = env.rollout(rng)
        for t in range(env.T):
            pos.append({"rollout_id": f"r{i}", "step": t + 1, "prediction": 0.0, "error": 1.0,
                        "n_steps": env.T})
            feats.append({"rollout_id": f"r{i}", "step": t + 1, "action": float(acts[t]),
                          "t": float(t)})
            truth[(f"r{i}", t + 1)] = (acts, t)
    full = sum(2 * (2 * (env.T - r["step"]) + 1) for r in pos)
    P = plan(pl.DataFrame(pos), budget=0.6 * full, seed=seed)  # p < 1: replay a subset
    labels = []
    for r in P.filter(pl.col("selected")).iter_rows(named=True):
        acts, t = truth[(r["rollout_id"], r["step"])]
        real, res = env.replay(acts, t, 4, rng)
        labels += [{"rollout_id": r["rollout_id"], "step": r["step"], "side": s, "sample": k,
                    "return": v} for s, vals in (("realized", real), ("resampled", res))
                   for k, v in enumerate(vals)]
    rollouts = pl.DataFrame({"rollout_id": [f"r{i}" for i in range(n)],
                             "task_id": [f"t{i % 10}" for i in range(n)],
                             "group_id": [f"t{i % 10}" for i in range(n)]})
    return P, pl.DataFrame(labels), pl.DataFrame(feats), rollouts


def test_heads_learn_the_sign_of_credit():
    P, L, F, _ = simulated()
    h = fit_heads(P, L, F, ridge=0.1)
    c, e = h.predict(F)
    acts = F["action"].to_numpy()
    assert c[acts == 1].mean() > 0 > c[acts == 0].mean()   # the right call earns credit
    assert (e >= 0).all() and h.version.startswith("heads-")


def test_cli_loop_plan_correct_fit_evolve(tmp_path):
    P, L, F, R = simulated(200)
    pos = P.select("rollout_id", "step", "prediction", "error", "n_steps")
    pos.write_parquet(tmp_path / "pos.parquet")
    L.write_parquet(tmp_path / "labels.parquet")
    F.write_parquet(tmp_path / "f.parquet")
    F.drop("action").write_parquet(tmp_path / "f_without_action.parquet")
    R.write_parquet(tmp_path / "rollouts.parquet")
    P.write_parquet(tmp_path / "plan.parquet")  # the plan the labels were made for
    res = run_draco("replay", "plan", "--positions", str(tmp_path / "pos.parquet"), "--budget",
                    "1e9", "-o", str(tmp_path / "slack.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    assert b"slack" in res.stderr
    res = run_draco("replay", "correct", "--plan", str(tmp_path / "plan.parquet"), "--labels",
                    str(tmp_path / "labels.parquet"), "-o", str(tmp_path / "c"))
    assert res.returncode == 0, res.stderr.decode()
    credit = pl.read_parquet(tmp_path / "c" / "credit.parquet")
    assert {"rollout_id", "step", "prediction", "delta", "p", "selected", "corrected",
            "advantage"} <= set(credit.columns)
    res = run_draco("replay", "fit", "--plan", str(tmp_path / "plan.parquet"), "--labels",
                    str(tmp_path / "labels.parquet"), "--features", str(tmp_path / "f.parquet"),
                    "--rollouts", str(tmp_path / "rollouts.parquet"), "-o",
                    str(tmp_path / "heads.json"))
    assert res.returncode == 0, res.stderr.decode()
    res = run_draco("replay", "plan", "--positions", str(tmp_path / "pos.parquet"), "--budget",
                    "2000", "--heads", str(tmp_path / "heads.json"), "--features",
                    str(tmp_path / "f.parquet"), "-o", str(tmp_path / "plan2.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    p2 = pl.read_parquet(tmp_path / "plan2.parquet")
    assert p2["head_version"][0].startswith("heads-") and p2["prediction"].std() > 0
    # features that repeat a positions column (a positions table given as --features): the
    # positions' own column, no `_right` copy in the plan
    F.join(pos.select("rollout_id", "step", "n_steps"), on=["rollout_id", "step"]).write_parquet(
        tmp_path / "f_n.parquet")
    res = run_draco("replay", "plan", "--positions", str(tmp_path / "pos.parquet"), "--budget",
                    "2000", "--heads", str(tmp_path / "heads.json"), "--features",
                    str(tmp_path / "f_n.parquet"), "-o", str(tmp_path / "plan3.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    p3 = pl.read_parquet(tmp_path / "plan3.parquet")
    assert not [c for c in p3.columns if c.endswith("_right")] and p3.equals(p2), p3.columns
    # a table that is not a plan, or a value out of range, named before any work
    pos.with_columns(pl.lit(-1.0).alias("error")).write_parquet(tmp_path / "pos_bad.parquet")
    for args, code, words in [
        (["plan", "--positions", str(tmp_path / "pos_bad.parquet"), "--budget", "2000", "-o",
          str(tmp_path / "p5.parquet")], 1, f"{tmp_path / 'pos_bad.parquet'}: field 'error'"),
        (["correct", "--plan", str(tmp_path / "pos.parquet"), "--labels",
          str(tmp_path / "labels.parquet"), "-o", str(tmp_path / "c2")], 1,
         f"{tmp_path / 'pos.parquet'}: field "),
        (["plan", "--positions", str(tmp_path / "pos.parquet"), "--budget", "inf", "-o",
          str(tmp_path / "p4.parquet")], 2, "--budget inf"),
        (["fit", "--plan", str(tmp_path / "plan.parquet"), "--labels",
          str(tmp_path / "labels.parquet"), "--features", str(tmp_path / "f.parquet"),
          "--ridge", "-1", "-o", str(tmp_path / "h2.json")], 2, "--ridge -1"),
        (["fit", "--plan", str(tmp_path / "plan.parquet"), "--labels",
          str(tmp_path / "labels.parquet"), "--features", str(tmp_path / "f.parquet"),
          "--holdout", "1.5", "-o", str(tmp_path / "h2.json")], 2, "--holdout 1.5"),
    ]:
        res = run_draco("replay", *args)
        err = res.stderr.decode()
        assert res.returncode == code and words in err and len(err.splitlines()) == 1, err
    res = run_draco("replay", "evolve", "--plan", str(tmp_path / "plan.parquet"), "--labels",
                    str(tmp_path / "labels.parquet"), "--rollouts",
                    str(tmp_path / "rollouts.parquet"), "--baseline",
                    str(tmp_path / "f_without_action.parquet"), "--candidate",
                    str(tmp_path / "f.parquet"), "-o", str(tmp_path / "evolve.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    ev = pl.read_parquet(tmp_path / "evolve.parquet")
    assert {"held_out_objective", "held_out_mse", "accepted"} <= set(ev.columns)
    # the feature that carries the credit (the action) must win
    assert ev.filter(pl.col("accepted"))["candidate"].to_list() == ["f"]
    res = run_draco("replay", "exact-check", "--json")
    assert res.returncode == 0


def test_credo_token_advantages_layout():
    from draco_cli.credo.tokens import credo_token_advantages
    from draco_cli.credit.tokens import spans_to_dense

    rollouts = pl.DataFrame({"rollout_id": ["a"], "group_id": ["g"], "response_len": [20],
                             "policy_spans": [[[0, 8], [12, 20]]]},
                            schema_overrides={"response_len": pl.Int32,
                                              "policy_spans": pl.List(pl.List(pl.Int32))})
    steps = pl.DataFrame({"rollout_id": ["a", "a"], "step": [1, 2], "n_tokens": [5, 4],
                          "token_start": [2, 14]},
                         schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32,
                                           "token_start": pl.Int32})
    credit = pl.DataFrame({"rollout_id": ["a", "a"], "step": [1, 2], "advantage": [0.5, -1.0],
                           "rloo": [0.4, 0.4], "corrected": [0.5, -1.0]})
    dense = spans_to_dense(credo_token_advantages(rollouts, steps, credit, beta=0.5))
    v = dense["advantages"][0].to_list()
    assert v[2:7] == [0.5] * 5 and v[14:18] == [-1.0] * 4      # a_t on every step token
    assert v[0:2] == pytest.approx([0.2, 0.2]) and v[7] == pytest.approx(0.2)  # gap: β·A_RLOO
    assert v[8:12] == [0.0] * 4                                  # observation
    dense0 = spans_to_dense(credo_token_advantages(rollouts, steps, credit, beta=0.0))
    assert dense0["advantages"][0].to_list()[0:2] == [0.0, 0.0]


def test_cost_takes_T_from_the_steps_table_not_the_listed_positions(tmp_path):
    """A positions file listing only some steps: T comes from the steps table."""
    pos = pl.DataFrame({"rollout_id": ["a", "a", "b"], "step": [1, 2, 1],
                        "prediction": [0.0, 0.0, 0.0], "error": [1.0, 1.0, 1.0]})
    steps = pl.DataFrame({"rollout_id": ["a"] * 5 + ["b"] * 3, "step": [1, 2, 3, 4, 5, 1, 2, 3]})
    with pytest.raises(UsageError, match="number of steps T"):
        plan(pos, budget=100)
    from draco_cli.credo import rollout_lengths

    P = plan(pos, budget=1000, n_steps=rollout_lengths(steps), replays=2)
    assert P["cost"].to_list() == [2 * 5 + 2 * 4, 2 * 4 + 2 * 3, 2 * 3 + 2 * 2]
    with pytest.raises(InputError, match="no number of steps"):
        plan(pos, budget=1000, n_steps=rollout_lengths(steps.filter(pl.col("rollout_id") == "a")))
    with pytest.raises(InputError, match="outside 1..T"):
        plan(pos.with_columns(pl.lit(9).alias("step")).head(1), 1000,
             n_steps=rollout_lengths(steps))
    pos.write_parquet(tmp_path / "pos.parquet")
    steps.write_parquet(tmp_path / "steps.parquet")
    res = run_draco("replay", "plan", "--positions", str(tmp_path / "pos.parquet"), "--budget",
                    "1000", "--steps", str(tmp_path / "steps.parquet"), "-o",
                    str(tmp_path / "plan.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    assert pl.read_parquet(tmp_path / "plan.parquet")["cost"].to_list() == [18, 14, 10]
    res = run_draco("replay", "plan", "--positions", str(tmp_path / "pos.parquet"), "--budget",
                    "20", "--steps", str(tmp_path / "steps.parquet"), "--allocation", "uniform",
                    "-o", str(tmp_path / "uni.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    uni = pl.read_parquet(tmp_path / "uni.parquet")
    assert uni["p"].n_unique() == 1 and (uni["p"] * uni["cost"]).sum() == pytest.approx(20)
    res = run_draco("replay", "plan", "--positions", str(tmp_path / "pos.parquet"), "--budget",
                    "1000", "-o", str(tmp_path / "p2.parquet"))
    assert res.returncode == 2 and b"--steps" in res.stderr and b"Traceback" not in res.stderr
    pos.head(0).write_parquet(tmp_path / "empty.parquet")
    res = run_draco("replay", "plan", "--positions", str(tmp_path / "empty.parquet"), "--budget",
                    "1000", "--steps", str(tmp_path / "steps.parquet"), "-o",
                    str(tmp_path / "p3.parquet"))
    assert res.returncode == 1 and b"no rows" in res.stderr
    assert not (tmp_path / "p3.parquet").exists()


def test_uniform_allocation_spends_what_sqrt_spends():
    pos = positions(8, 5, seed=3)
    for budget in (40.0, 120.0, 1e6):  # tight, moderate, slack
        s = plan(pos, budget, seed=1)
        u = plan(pos, budget, seed=1, allocation="uniform")
        assert u["p"].n_unique() == 1 and u["allocation"][0] == "uniform"
        assert (u["p"] * u["cost"]).sum() == pytest.approx((s["p"] * s["cost"]).sum(), rel=1e-9)
        assert u["expected_cost"][0] == pytest.approx(s["expected_cost"][0], rel=1e-9)
    with pytest.raises(UsageError, match="sqrt or uniform"):
        plan(pos, 100, allocation="oracle")


def test_refused_inputs_clip_and_conflicting_labels():
    P = pl.DataFrame({"rollout_id": ["a"], "step": [1], "prediction": [0.0], "p": [0.5],
                      "selected": [True]})
    L = pl.DataFrame({"rollout_id": ["a"] * 3, "step": [1] * 3,
                      "side": ["realized", "resampled", "realized"], "sample": [0, 0, 0],
                      "return": [1.0, 0.0, 0.0]})
    with pytest.raises(InputError, match="conflicting duplicate labels"):
        correct(P, L)
    same = L.with_columns(pl.Series("return", [1.0, 0.0, 1.0]))
    out, _ = correct(P, same)  # an identical duplicate is one label, not two
    assert out["delta"][0] == 1.0
    for bad in (-1.0, 0.0):
        with pytest.raises(UsageError, match="--clip must be > 0"):
            correct(P, same, clip=bad)


def test_heads_with_reward_feature_refuse_features_without_rewards():
    from draco_cli.credo import Heads, draco_features

    sc = pl.DataFrame({"rollout_id": ["a", "a"], "step": [1, 2], "n_tokens": [3, 4],
                       "p": [1, 0], "f": [0, 1], "quality": [1.0, 0.0], "cited": [True, True]})
    with_r = draco_features(sc, pl.DataFrame({"rollout_id": ["a"], "reward": [0.9]}))
    without = draco_features(sc, None)
    assert "reward" in with_r.columns and "reward" not in without.columns
    h = Heads(["quality", "reward"], [0.0, 1.0, 1.0], [0.1, 0.0, 0.0], 1.0, "heads-x", 2)
    assert h.predict(with_r)[0].tolist() == pytest.approx([1.9, 0.9])
    with pytest.raises(InputError, match="pass --rewards"):
        h.predict(without)


def test_fit_prints_held_out_calibration_of_both_heads(tmp_path):
    P, L, F, R = simulated(200)
    for name, df in (("plan", P), ("labels", L), ("f", F), ("rollouts", R)):
        df.write_parquet(tmp_path / f"{name}.parquet")
    res = run_draco("replay", "fit", "--plan", str(tmp_path / "plan.parquet"), "--labels",
                    str(tmp_path / "labels.parquet"), "--features", str(tmp_path / "f.parquet"),
                    "--rollouts", str(tmp_path / "rollouts.parquet"), "-o",
                    str(tmp_path / "heads.json"))
    assert res.returncode == 0, res.stderr.decode()
    err = res.stderr.decode()
    assert "held-out calibration on" in err and "mean_prediction" in err
    assert "credit" in err and "error" in err
    res = run_draco("replay", "fit", "--plan", str(tmp_path / "plan.parquet"), "--labels",
                    str(tmp_path / "labels.parquet"), "--features", str(tmp_path / "f.parquet"),
                    "--rollouts", str(tmp_path / "rollouts.parquet"), "-o",
                    str(tmp_path / "heads2.json"), "--cross-fit", "3", "--predictions",
                    str(tmp_path / "cf.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    assert pl.read_parquet(tmp_path / "cf.parquet").height == F.height
    # folds by hash: fewer tasks than folds leave folds empty, and the line says so
    import hashlib

    def h(t):
        return int(hashlib.sha256(str(t).encode()).hexdigest(), 16)
    tasks = R["task_id"].unique().sort().to_list()
    held = next(t for t in tasks if h(t) % 1000 < 500)
    kept = next(t for t in tasks if h(t) % 1000 >= 500 and h(t) % 6 != h(held) % 6)
    two = R.filter(pl.col("task_id").is_in([held, kept]))
    two.write_parquet(tmp_path / "two.parquet")
    res = run_draco("replay", "fit", "--plan", str(tmp_path / "plan.parquet"), "--labels",
                    str(tmp_path / "labels.parquet"), "--features", str(tmp_path / "f.parquet"),
                    "--rollouts", str(tmp_path / "two.parquet"), "--holdout", "0.5", "-o",
                    str(tmp_path / "heads3.json"), "--cross-fit", "6", "--predictions",
                    str(tmp_path / "cf3.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    assert "over 2 folds (of 6 asked: tasks are split by hash, and 4 folds got none)" in \
        res.stderr.decode(), res.stderr.decode()
    from draco_cli.credo import fit_with_holdout

    _, cal, _ = fit_with_holdout(P, L, F, R)
    assert set(cal["head"]) == {"credit", "error"}
    cred = cal.filter(pl.col("head") == "credit")
    # a calibrated credit head: bin means rise with the prediction
    assert cred["mean_target"][-1] > cred["mean_target"][0]


def test_cross_fit_predicts_each_fold_from_the_others():
    from draco_cli.credo import cross_fit

    P, L, F, R = simulated(200)
    cf = cross_fit(P, L, F, R, folds=4)
    assert cf.height == F.height and 2 <= cf["fold"].n_unique() <= 4
    assert cf.group_by("fold").agg(pl.col("head_version").n_unique())["head_version"].max() == 1
    assert cf["head_version"].n_unique() == cf["fold"].n_unique()
    acts = F.join(cf, on=["rollout_id", "step"])
    assert acts.filter(pl.col("action") == 1)["prediction"].mean() > \
        acts.filter(pl.col("action") == 0)["prediction"].mean()


@pytest.mark.parametrize("mode", ["uniform", "grpo_fallback", "step"])
def test_policy_spans_past_the_last_step_without_response_len(mode):
    """Positions known, response_len null, a policy span after the last step (a final message):
    the length covers the span in every mode, no span lies past it, dense form works."""
    from draco_cli.credit.tokens import spans_to_dense
    from tests.credit_tables import build_token_advantages

    rollouts = pl.DataFrame({"rollout_id": ["a"], "group_id": ["g"], "response_len": [None],
                             "policy_spans": [[[0, 6], [10, 14], [20, 25]]]},
                            schema_overrides={"response_len": pl.Int32,
                                              "policy_spans": pl.List(pl.List(pl.Int32))})
    sc = pl.DataFrame({"rollout_id": ["a", "a"], "step": [1, 2], "n_tokens": [4, 4],
                       "token_start": [2, 10], "advantage": [0.5, 0.25]},
                      schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32,
                                        "token_start": pl.Int32})
    rewards = pl.DataFrame({"rollout_id": ["a"], "advantage": [1.0], "credit_mode": [mode]})
    spans = build_token_advantages(rollouts, sc, rewards)
    assert spans["length"][0] == 25
    assert max(spans["span_end"][0].to_list()) <= 25
    v = spans_to_dense(spans)["advantages"][0].to_list()
    assert len(v) == 25
    if mode == "step":
        assert v[2:6] == [0.5] * 4 and v[20:25] == [0.0] * 5   # gap tokens get 0
    else:
        assert v[20:25] == [1.0] * 5 and v[0:6] == [1.0] * 6   # every policy token gets A_i
    assert v[6:10] == [0.0] * 4                                  # observation


def test_replay_count_sweep_at_fixed_budget():
    from draco_cli.credo.exact_check import sweep_replays

    rows = sweep_replays((1, 2, 4, 8))
    assert all(r["max_abs_error"] < 1e-9 for r in rows)
    costs = [r["expected_cost"] for r in rows]
    assert max(costs) == pytest.approx(min(costs), rel=1e-9)       # one budget for every M
    var = {r["M"]: r["variance"] for r in rows}
    assert var[8] > var[4] > var[2]    # at a fixed budget, more replays per position cost coverage
    res = run_draco("replay", "exact-check", "--sweep-replays", "1,2,4", "--json")
    assert res.returncode == 0 and len(json.loads(res.stdout)) == 9 + 3
