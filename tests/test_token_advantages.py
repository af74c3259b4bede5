"""Token advantages: values per token class, layouts, exact dense <-> spans round trips."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.credit import compute_credit
from draco_cli.credit.tokens import dense_to_spans, spans_to_dense
from tests.conftest import examples
from tests.credit_tables import build_token_advantages


def setup(credit="step", token_start=True, spans=True, verdicts=None):
    # Response: [0,5) gap text, [5,15) step 1, [15,20) observation, [20,30) step 2, [30,34) gap.
    rollouts = pl.DataFrame({
        "rollout_id": ["win", "lose"], "group_id": ["g", "g"], "task_id": ["t", "t"],
        "outcome": [1.0, 0.0], "response_len": [34, 34],
        "policy_spans": [[[0, 15], [20, 34]]] * 2 if spans else [None, None],
    }, schema_overrides={"response_len": pl.Int32, "policy_spans": pl.List(pl.List(pl.Int32))})
    steps = pl.DataFrame({
        "rollout_id": ["win", "win", "lose", "lose"], "step": [1, 2, 1, 2],
        "n_tokens": [10, 10, 10, 10],
        "token_start": [5, 20, 5, 20] if token_start else [None] * 4,
    }, schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32, "token_start": pl.Int32})
    verdicts = verdicts if verdicts is not None else pl.DataFrame({
        "rollout_id": ["win", "lose", "win", "lose"], "criterion_id": ["a", "a", "b", "b"],
        "judge": ["j"] * 4, "verdict": ["pass", "fail", "fail", "fail"],
        "cited_steps": [[1], [1], [2], [2]],
    }, schema_overrides={"cited_steps": pl.List(pl.Int32)})
    res = compute_credit(rollouts, steps, verdicts, credit=credit)
    ta = build_token_advantages(rollouts, res.step_credit, res.rewards)
    return res, ta


def dense_of(ta, rid):
    d = spans_to_dense(ta)
    return np.array(d.filter(pl.col("rollout_id") == rid)["advantages"][0], dtype=np.float32)


def test_step_credit_values_per_token_class():
    res, ta = setup()
    A = dict(res.rewards.select("rollout_id", "advantage").iter_rows())
    sc = {(r["rollout_id"], r["step"]): r["advantage"] for r in res.step_credit.iter_rows(named=True)}
    win = dense_of(ta, "win")
    assert win.shape == (34,)
    assert (win[:5] == 0).all() and (win[15:20] == 0).all() and (win[30:] == 0).all()  # gap, obs
    assert (win[5:15] == np.float32(sc[("win", 1)])).all()
    assert (win[20:30] == np.float32(sc[("win", 2)])).all()
    # winner: step 1 passed (Q=1), step 2 failed (Q=0) → all credit on step 1
    assert sc[("win", 2)] == 0 and sc[("win", 1)] == pytest.approx(A["win"] * 2)
    lose = dense_of(ta, "lose")
    assert (lose[5:15] < 0).all() and (lose[20:30] < 0).all()
    assert ta["layout"].to_list() == ["positions", "positions"]
    assert ta["length"].to_list() == [34, 34]


def test_uniform_gives_every_policy_token_A_including_gap():
    res, ta = setup(credit="uniform")
    A = dict(res.rewards.select("rollout_id", "advantage").iter_rows())
    win = dense_of(ta, "win")
    expect = np.zeros(34, dtype=np.float32)
    expect[0:15] = A["win"]
    expect[20:34] = A["win"]
    np.testing.assert_array_equal(win, expect)
    assert res.rewards["credit_mode"].to_list() == ["uniform", "uniform"]


def test_fallback_gives_gap_tokens_A():
    uncited = pl.DataFrame({
        "rollout_id": ["win", "lose"], "criterion_id": ["a", "a"], "judge": ["j"] * 2,
        "verdict": ["pass", "fail"], "cited_steps": [[], []]},
        schema_overrides={"cited_steps": pl.List(pl.Int32)})
    res, ta = setup(verdicts=uncited)
    assert res.rewards["credit_mode"].to_list() == ["grpo_fallback"] * 2
    A = dict(res.rewards.select("rollout_id", "advantage").iter_rows())
    lose = dense_of(ta, "lose")
    assert (lose[0:15] == np.float32(A["lose"])).all() and (lose[15:20] == 0).all()


def test_without_policy_spans_policy_tokens_are_the_steps():
    res, ta = setup(credit="uniform", spans=False)
    A = dict(res.rewards.select("rollout_id", "advantage").iter_rows())
    win = dense_of(ta, "win")
    assert (win[:5] == 0).all() and (win[5:15] == np.float32(A["win"])).all()


def test_end_to_end_layout_without_positions():
    res, ta = setup(token_start=False)
    assert ta["layout"].to_list() == ["end_to_end"] * 2
    assert ta["length"].to_list() == [20, 20]
    win = dense_of(ta, "win")
    assert win.shape == (20,)
    assert win.sum() * 1 == pytest.approx(sum(res.step_credit.filter(
        pl.col("rollout_id") == "win")["total"]), rel=1e-6)


def test_spans_are_canonical():
    _, ta = setup(credit="uniform")
    # adjacent policy span pieces with equal value are one span; zeros are never spans
    row = ta.filter(pl.col("rollout_id") == "win").row(0, named=True)
    assert row["span_start"] == [0, 20] and row["span_end"] == [15, 34]


dense_rows = st.lists(
    st.lists(st.sampled_from([0.0, 0.0, 1.5, -2.25, 3.0, 1e-8, -0.0]), max_size=40),
    min_size=1, max_size=12)


@settings(max_examples=examples(300), deadline=None)
@given(dense_rows)
def test_dense_spans_dense_is_exact(rows):
    df = pl.DataFrame({"rollout_id": [f"r{i}" for i in range(len(rows))],
                       "layout": ["positions"] * len(rows),
                       "advantages": [np.array(r, dtype=np.float32) + np.float32(0) for r in rows]},
                      schema_overrides={"advantages": pl.List(pl.Float32)})
    spans = dense_to_spans(df)
    back = spans_to_dense(spans)
    for a, b in zip(df["advantages"], back["advantages"]):
        assert a.to_list() == b.to_list()
    again = dense_to_spans(back)
    for c in ("span_start", "span_end", "span_value", "length"):
        assert again[c].to_list() == spans[c].to_list()


def test_block_processing_gives_the_same_result(monkeypatch):
    """Credit and token spans work block by block; tiny blocks must change nothing."""
    import draco_cli.credit.inputs as credit_mod

    whole_res, whole_ta = setup()
    whole_u = setup(credit="uniform")
    monkeypatch.setattr(credit_mod, "CHUNK_STEPS", 1)
    res, ta = setup()
    assert res.step_credit.equals(whole_res.step_credit)
    assert ta.equals(whole_ta)
    u = setup(credit="uniform")
    assert u[1].equals(whole_u[1])


def test_blocks_on_random_inputs(monkeypatch):
    import draco_cli.credit.inputs as credit_mod
    from tests.test_credit import frames
    rng = np.random.default_rng(3)
    rollouts, steps, verdicts = [], [], []
    for i in range(40):
        m = int(rng.integers(0, 6))
        rollouts.append({"rollout_id": f"r{i}", "group_id": f"g{i // 4}", "task_id": "t",
                         "outcome": 1.0})
        for j in range(1, m + 1):
            steps.append({"rollout_id": f"r{i}", "step": j, "n_tokens": int(rng.integers(1, 50)),
                          "token_start": None})
        for c in range(3):
            verdicts.append({"rollout_id": f"r{i}", "criterion_id": f"c{c}", "judge": "j",
                             "verdict": str(rng.choice(["pass", "fail", "na"])),
                             "cited_steps": [int(x) for x in rng.integers(0, m + 2, size=2)]})
    r, s, v = frames(rollouts, steps, verdicts)
    r = r.with_columns(pl.lit(None, pl.Int32).alias("response_len"),
                       pl.lit(None, pl.List(pl.List(pl.Int32))).alias("policy_spans"))
    outs = []
    for chunk in (None, 1, 3, 7):
        if chunk:
            monkeypatch.setattr(credit_mod, "CHUNK_STEPS", chunk)
        res = compute_credit(r, s, v)
        outs.append((res.step_credit, build_token_advantages(r, res.step_credit, res.rewards)))
    for sc, ta in outs[1:]:
        assert sc.equals(outs[0][0]) and ta.equals(outs[0][1])
