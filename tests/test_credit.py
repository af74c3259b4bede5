"""Credit core: the worked example, properties on random inputs, a reference, edge cases."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.credit import compute_credit, discriminative_filter, group_advantage
from draco_cli.errors import InputError, UsageError
from tests.credit_tables import step_credit_table
from tests.reference_credit import reference
from tests.conftest import examples


def frames(rollouts, steps, verdicts):
    r = pl.DataFrame(rollouts, schema={"rollout_id": pl.String, "group_id": pl.String,
                                       "task_id": pl.String, "outcome": pl.Float64})
    s = pl.DataFrame(steps, schema={"rollout_id": pl.String, "step": pl.Int32,
                                    "n_tokens": pl.Int32, "token_start": pl.Int32})
    v = pl.DataFrame(verdicts, schema={"rollout_id": pl.String, "criterion_id": pl.String,
                                       "judge": pl.String, "verdict": pl.String,
                                       "cited_steps": pl.List(pl.Int32)})
    return r, s, v


# --- the DRACO appendix worked example (SPEC §3.6) ----------------------------------------

N_TOK = [40, 40, 30, 50, 30, 60, 60]
# Citations giving Q = [1, 1, 1/2, 1/3, 1/2, 1/3] on steps 1-6; step 7 uncited.
CITES = [("c1", "pass", [1, 2, 3, 4, 5, 6]), ("c2", "fail", [3, 4, 6]),
         ("c3", "fail", [4, 5, 6]), ("c4", "pass", [5]), ("c5", "fail", [5])]


def worked(A):
    steps = pl.DataFrame({"rollout_id": ["w"] * 7, "step": list(range(1, 8)), "n_tokens": N_TOK},
                         schema={"rollout_id": pl.String, "step": pl.Int32, "n_tokens": pl.Int32})
    verdicts = pl.DataFrame(
        {"rollout_id": ["w"] * 5, "criterion_id": [c for c, _, _ in CITES],
         "verdict": [v for _, v, _ in CITES], "cited_steps": [s for _, _, s in CITES],
         "retained": [True] * 5},
        schema_overrides={"cited_steps": pl.List(pl.Int32)},
    )
    adv = pl.DataFrame({"rollout_id": ["w"], "advantage": [A]})
    table, modes, dropped = step_credit_table(steps, verdicts, adv)
    assert dropped == 0
    return table.sort("step"), modes


def test_worked_example_winner():
    t, modes = worked(1.0)
    assert modes["credit_mode"].to_list() == ["step"]
    q = t["quality"].to_list()
    assert q[:6] == [1.0, 1.0, 0.5, 1 / 3, 0.5, 1 / 3]
    assert q[6] == pytest.approx(0.6111111111, abs=1e-10)
    assert sum(t["weight"]) == pytest.approx(4.2778, abs=5e-5)
    assert [round(a, 4) for a in t["advantage"]] == [1.8117, 1.8117, 1.2078, 0.4831, 1.2078,
                                                     0.4026, 0.7381]
    assert [round(x, 2) for x in t["total"]] == [72.47, 72.47, 36.23, 24.16, 36.23, 24.16, 44.29]
    assert sum(t["total"]) == pytest.approx(310, abs=1e-9)


def test_worked_example_loser():
    t, _ = worked(-1.0)
    assert [round(x, 2) + 0.0 for x in t["total"]] == [0.0, 0.0, -56.94, -75.92, -56.94, -75.92,
                                                       -44.29]
    assert sum(t["total"]) == pytest.approx(-310, abs=1e-9)


# --- properties on random rollouts (SPEC §3.6) --------------------------------------------

rollout_st = st.integers(1, 12).flatmap(lambda m: st.tuples(
    st.lists(st.integers(1, 400), min_size=m, max_size=m),                 # n_j
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=m, max_size=m),  # p, f
    st.one_of(st.just(0.0), st.floats(-5, 5, allow_nan=False)),           # A_i
))


def run_props(rollouts, scale=1.0, flip_quality=False, credit="step"):
    srows, vrows, arows = [], [], []
    for i, (n, pf, A) in enumerate(rollouts):
        rid = f"r{i}"
        for j, (nj, (p, f)) in enumerate(zip(n, pf), start=1):
            srows.append((rid, j, nj))
            if flip_quality:
                p, f = f, p
            # p passed and f failed criteria citing step j (one verdict each)
            vrows += [(rid, f"s{j}p{k}", "pass", [j], True) for k in range(p)]
            vrows += [(rid, f"s{j}f{k}", "fail", [j], True) for k in range(f)]
        arows.append((rid, A * scale))
    steps = pl.DataFrame(srows, schema={"rollout_id": pl.String, "step": pl.Int32,
                                        "n_tokens": pl.Int32}, orient="row")
    verdicts = pl.DataFrame(vrows, schema={"rollout_id": pl.String, "criterion_id": pl.String,
                                           "verdict": pl.String, "cited_steps": pl.List(pl.Int32),
                                           "retained": pl.Boolean}, orient="row")
    adv = pl.DataFrame(arows, schema={"rollout_id": pl.String, "advantage": pl.Float64},
                       orient="row")
    table, modes, _ = step_credit_table(steps, verdicts, adv, credit)
    return table.sort("rollout_id", "step"), dict(modes.iter_rows())


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(rollout_st, min_size=1, max_size=30))
def test_conservation_sign_and_modes(rollouts):
    table, modes = run_props(rollouts)
    for i, (n, pf, A) in enumerate(rollouts):
        mine = table.filter(pl.col("rollout_id") == f"r{i}")
        N = sum(n)
        assert sum(mine["total"]) == pytest.approx(A * N, rel=1e-9, abs=1e-9)   # conservation
        for a in mine["advantage"]:
            assert a == 0 or math.copysign(1, a) == math.copysign(1, A)       # never inverted
        cited = any(p + f for p, f in pf)
        assert modes[f"r{i}"] == ("step" if cited else "grpo_fallback")
        if not cited:
            assert mine["advantage"].to_list() == [A] * len(n)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(rollout_st, min_size=1, max_size=20), st.floats(0.01, 100), st.randoms())
def test_length_independence_and_linearity(rollouts, c, rnd):
    base, _ = run_props(rollouts)
    # Step totals do not depend on n_j: redraw every n_j.
    redrawn = [([rnd.randint(1, 400) for _ in n], pf, A) for n, pf, A in rollouts]
    other, _ = run_props(redrawn)
    for (n, pf, _), (n2, _, _), i in zip(rollouts, redrawn, range(len(rollouts))):
        if not any(p + f for p, f in pf):
            continue  # nothing cited: baseline GRPO, whose totals do scale with n_j
        t1 = base.filter(pl.col("rollout_id") == f"r{i}")["total"].to_numpy() / sum(n)
        t2 = other.filter(pl.col("rollout_id") == f"r{i}")["total"].to_numpy() / sum(n2)
        np.testing.assert_allclose(t1, t2, rtol=1e-9, atol=1e-12)
    # a_j scales linearly with A_i under positive scaling.
    scaled, _ = run_props(rollouts, scale=c)
    np.testing.assert_allclose(scaled["advantage"].to_numpy(), c * base["advantage"].to_numpy(),
                               rtol=1e-9, atol=1e-12)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(rollout_st, min_size=1, max_size=20))
def test_mirror_symmetry(rollouts):
    """A loser step of quality Q gets the weight a winner step of quality 1 − Q gets."""
    losers = [(n, pf, -abs(A) - 0.5) for n, pf, A in rollouts]
    winners = [(n, pf, abs(A) + 0.5) for n, pf, A in rollouts]
    lose, _ = run_props(losers)
    win, _ = run_props(winners, flip_quality=True)
    np.testing.assert_allclose(lose["weight"].fill_null(-1).to_numpy(),
                               win["weight"].fill_null(-1).to_numpy(), rtol=1e-12)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 400), min_size=1, max_size=10),
                          st.sampled_from([(1, 0), (0, 1), (2, 2)]),
                          st.floats(-5, 5, allow_nan=False)), min_size=1, max_size=20))
def test_constant_weights_give_equal_totals(rollouts):
    # Every step has the same (p, f), so the same quality and weight.
    expanded = [(n, [pf] * len(n), A) for n, pf, A in rollouts]
    table, _ = run_props(expanded)
    for i, (n, _, A) in enumerate(expanded):
        totals = table.filter(pl.col("rollout_id") == f"r{i}")["total"].to_numpy()
        np.testing.assert_allclose(totals, A * sum(n) / len(n), rtol=1e-9, atol=1e-12)


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(rollout_st, min_size=1, max_size=20))
def test_uniform_mode_is_baseline_grpo(rollouts):
    table, modes = run_props(rollouts, credit="uniform")
    for i, (n, _, A) in enumerate(rollouts):
        mine = table.filter(pl.col("rollout_id") == f"r{i}")
        assert mine["advantage"].to_list() == [A] * len(n)
        assert modes[f"r{i}"] == "uniform"


# --- the whole computation against the pure-Python reference ------------------------------

@st.composite
def pipeline_inputs(draw):
    n_groups = draw(st.integers(1, 4))
    rollouts, steps, verdicts = [], [], []
    for g in range(n_groups):
        size = draw(st.integers(1, 5))
        n_crit = draw(st.integers(0, 5))
        for k in range(size):
            rid = f"g{g}r{k}"
            rollouts.append({"rollout_id": rid, "group_id": f"g{g}", "task_id": f"t{g}",
                             "outcome": float(draw(st.integers(0, 1)))})
            m = draw(st.integers(0, 6))
            for j in range(1, m + 1):
                steps.append({"rollout_id": rid, "step": j, "n_tokens": draw(st.integers(1, 300)),
                              "token_start": None})
            for c in range(n_crit):
                verdict = draw(st.sampled_from(["pass", "fail", "na", None]))
                cites = draw(st.lists(st.integers(0, m + 2), max_size=4))
                verdicts.append({"rollout_id": rid, "criterion_id": f"c{c}", "judge": "j",
                                 "verdict": verdict, "cited_steps": cites})
    return rollouts, steps, verdicts


@settings(max_examples=examples(200), deadline=None)
@given(pipeline_inputs(), st.sampled_from(["step", "uniform"]),
       st.sampled_from([("grpo", "sample"), ("grpo", "population"), ("grpo", "none"),
                        ("rloo", "sample")]),
       st.sampled_from(["all-pass", "constant"]))
def test_matches_reference(inputs, credit, est_std, drop):
    rollouts, steps, verdicts = inputs
    estimator, std = est_std
    r, s, v = frames(rollouts, steps, verdicts)
    res = compute_credit(r, s, v, credit=credit, estimator=estimator, std=std, drop=drop)
    ref_r, ref_steps = reference(rollouts, steps, verdicts, credit=credit, estimator=estimator,
                                 std=std, drop=drop)
    for row in res.rewards.iter_rows(named=True):
        reward, A, mode = ref_r[row["rollout_id"]]
        assert row["reward"] == (pytest.approx(reward, abs=1e-12) if reward is not None else None)
        assert row["advantage"] == pytest.approx(A, rel=1e-9, abs=1e-9)
        assert row["credit_mode"] == mode
    for row in res.step_credit.iter_rows(named=True):
        assert row["advantage"] == pytest.approx(ref_steps[(row["rollout_id"], row["step"])],
                                                 rel=1e-9, abs=1e-9)
    assert res.step_credit.height == len(steps)


# --- edge cases, each by name -------------------------------------------------------------

def simple(verdicts, steps=None, rollouts=None, **kw):
    rollouts = rollouts or [{"rollout_id": f"r{i}", "group_id": "g", "task_id": "t",
                             "outcome": 1.0} for i in range(3)]
    steps = steps if steps is not None else [
        {"rollout_id": f"r{i}", "step": j, "n_tokens": 10, "token_start": None}
        for i in range(3) for j in (1, 2)]
    return compute_credit(*frames(rollouts, steps, verdicts), **kw)


def V(rid, crit, verdict, cites=(), judge="j"):
    return {"rollout_id": rid, "criterion_id": crit, "judge": judge, "verdict": verdict,
            "cited_steps": list(cites)}


def test_filter_drops_criteria_nobody_failed():
    res = simple([V("r0", "a", "pass", [1]), V("r1", "a", "pass"), V("r2", "a", "pass"),
                  V("r0", "b", "fail", [2]), V("r1", "b", "pass", [1]), V("r2", "b", "na")])
    assert res.stats.criteria_kept == 1 and res.stats.criteria_dropped == 1
    rw = {r["rollout_id"]: r for r in res.rewards.iter_rows(named=True)}
    assert (rw["r0"]["n_pass"], rw["r0"]["n_fail"], rw["r0"]["reward"]) == (0, 1, 0.0)
    assert rw["r1"]["reward"] == 1.0
    assert rw["r2"]["reward"] is None and rw["r2"]["advantage"] == 0.0   # na only: no reward
    assert rw["r0"]["pass_rate_all"] == 0.5 and rw["r2"]["pass_rate_all"] == 1.0
    # two scored members: A = ±(0.5 / std) with sample std of [0, 1] = 0.7071
    assert rw["r1"]["advantage"] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6))


def test_drop_constant_also_drops_all_fail():
    verdicts = [V("r0", "a", "fail"), V("r1", "a", "fail"), V("r2", "a", None),
                V("r0", "b", "fail"), V("r1", "b", "pass"), V("r2", "b", "pass")]
    kept = simple(verdicts).stats.criteria_kept
    assert kept == 2
    assert simple(verdicts, drop="constant").stats.criteria_kept == 1


def test_one_member_and_constant_groups_get_zero():
    rollouts = [{"rollout_id": "solo", "group_id": "g1", "task_id": "t", "outcome": 1.0},
                {"rollout_id": "x", "group_id": "g2", "task_id": "t2", "outcome": 1.0},
                {"rollout_id": "y", "group_id": "g2", "task_id": "t2", "outcome": 1.0}]
    steps = [{"rollout_id": r, "step": 1, "n_tokens": 5, "token_start": None}
             for r in ("solo", "x", "y")]
    verdicts = [V("solo", "a", "fail", [1]), V("x", "a", "fail", [1]), V("y", "a", "fail", [1]),
                V("x", "b", "pass", [1]), V("y", "b", "pass", [1])]
    res = simple(verdicts, steps, rollouts)
    assert res.rewards["advantage"].to_list() == [0.0, 0.0, 0.0]
    # the equal-rewards rule holds with --std none too, where float noise could leak through
    assert simple(verdicts, steps, rollouts, std="none").rewards["advantage"].to_list() == [0.0] * 3


def test_equal_rewards_with_float_noise_are_exactly_zero():
    adv = group_advantage(pl.DataFrame({"group_id": ["g"] * 3, "reward": [0.1, 0.1, 0.1]}),
                          std="none")
    assert adv.to_list() == [0.0, 0.0, 0.0]


def test_no_action_rollout_falls_back_to_grpo():
    steps = [{"rollout_id": "r0", "step": 1, "n_tokens": 10, "token_start": None},
             {"rollout_id": "r1", "step": 1, "n_tokens": 10, "token_start": None}]
    res = simple([V("r0", "a", "fail", [1]), V("r1", "a", "pass", [1]), V("r2", "a", "pass")],
                 steps=steps)
    modes = dict(res.rewards.select("rollout_id", "credit_mode").iter_rows())
    assert modes == {"r0": "step", "r1": "step", "r2": "grpo_fallback"}


def test_sum_of_weights_zero_gives_equal_shares():
    # r1 is a winner whose only cited step failed on a retained criterion: Q = 0 everywhere.
    verdicts = [V("r0", "a", "fail", [1]), V("r1", "a", "fail", [2]), V("r1", "b", "pass", []),
                V("r0", "b", "fail"), V("r2", "a", "fail"), V("r2", "b", "fail")]
    steps = [{"rollout_id": "r1", "step": 1, "n_tokens": 10, "token_start": None},
             {"rollout_id": "r1", "step": 2, "n_tokens": 30, "token_start": None}]
    res = simple(verdicts, steps=steps)
    A = res.rewards.filter(pl.col("rollout_id") == "r1")["advantage"][0]
    assert A > 0
    sc = res.step_credit.sort("step")
    assert sc["weight"].to_list() == [0.5, 0.5]
    assert sc["total"].to_list() == pytest.approx([A * 40 / 2, A * 40 / 2])


def test_citations_outside_steps_are_dropped_and_counted():
    res = simple([V("r0", "a", "fail", [0, 1, 3, 99]), V("r1", "a", "pass", [2])])
    assert res.stats.citations_dropped == 3


def test_several_judges_need_judge():
    verdicts = [V("r0", "a", "fail", [1], judge="frontier"), V("r0", "a", "pass", [1], judge="self")]
    with pytest.raises(UsageError, match=r"several judges \(frontier, self\); choose one with --judge"):
        simple(verdicts)
    assert simple(verdicts, judge="self").stats.criteria_kept == 0
    with pytest.raises(UsageError, match="--judge 'x'"):
        simple(verdicts, judge="x")


def test_verdict_for_unknown_rollout_is_an_error():
    with pytest.raises(InputError, match=r"verdicts: row 1: field 'rollout_id': verdict for "
                                         r"unknown rollout 'ghost'"):
        simple([V("r0", "a", "fail"), V("ghost", "a", "pass")])


def test_a_rollout_without_a_group_is_an_error_not_a_group_of_its_own():
    """In-memory frames skip the contract's check: a null group_id would pool every such
    rollout into one group's baseline."""
    from draco_cli.credit import attach_groups

    rollouts = [{"rollout_id": "r0", "group_id": "g", "task_id": "t"},
                {"rollout_id": "r1", "group_id": None, "task_id": "t"}]
    with pytest.raises(InputError, match=r"rollouts: row 1: field 'group_id': rollout 'r1' "
                                         r"has no group_id"):
        simple([V("r0", "a", "fail"), V("r1", "a", "pass")], rollouts=rollouts)
    with pytest.raises(InputError, match="rollout 'r1' has no group_id"):
        attach_groups(pl.DataFrame({"rollout_id": ["r1"]}),
                      pl.DataFrame(rollouts, schema={"rollout_id": pl.String,
                                                     "group_id": pl.String,
                                                     "task_id": pl.String}), "verdicts")


def test_steps_not_contiguous_is_an_error():
    steps = [{"rollout_id": "r0", "step": 1, "n_tokens": 10, "token_start": None},
             {"rollout_id": "r0", "step": 3, "n_tokens": 10, "token_start": None}]
    with pytest.raises(InputError, match=r"steps: row 0: field 'step': steps of rollout 'r0'"):
        simple([V("r0", "a", "fail")], steps=steps)


def test_outcome_reward_and_rloo():
    rollouts = [{"rollout_id": f"r{i}", "group_id": "g", "task_id": "t", "outcome": o}
                for i, o in enumerate([1.0, 0.0, 0.0, None])]
    res = simple([], steps=[], rollouts=rollouts, reward="outcome", estimator="rloo")
    adv = res.rewards["advantage"].to_list()
    assert adv == pytest.approx([1.0, -0.5, -0.5, 0.0])


def test_filter_is_the_same_code_as_judge_filter():
    v = pl.DataFrame([V("r0", "a", "fail"), V("r1", "a", "pass"), V("r0", "b", "pass")])
    out = discriminative_filter(v.with_columns(pl.lit("g").alias("group_id")))
    assert out["retained"].to_list() == [True, True, False]
