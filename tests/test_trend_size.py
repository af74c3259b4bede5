"""The audits' trend tests hold their size (SPEC §4): each train step is one observation, so
under no trend but ordinary step-to-step variation they reject at about their nominal rate —
where a test pooling every verdict as independent rejects far more often."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from scipy import stats

from draco_cli.audit.overlap import overlap_tests
from draco_cli.audit.self_judge import self_judge_audit
from draco_cli.audit.stats import step_trend, welch_t
from tests.pooled_trend import logistic_trend


def null_datasets(n_sets, steps=11, seed=0):
    """Per-step agreement counts with no trend: each step's rate varies around 0.7 (sd 0.05,
    the step's rollouts, rubric and judge state), 200-800 verdicts per step."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(200, 800, size=(n_sets, steps))
    rate = np.clip(0.7 + rng.normal(0, 0.05, size=(n_sets, steps)), 0.01, 0.99)
    return rows, rng.binomial(rows, rate)


def test_step_level_tests_reject_at_their_nominal_rate_under_no_trend():
    rows, hits = null_datasets(500)
    x = np.arange(1, rows.shape[1] + 1, dtype=float)
    q = int(np.ceil(len(x) / 4))
    trend = welch = 0
    for n, k in zip(rows, hits):
        _, _, p = step_trend(k / n, x, n)
        trend += p < 0.05
        _, pw = welch_t((k / n)[:q], (k / n)[-q:])
        welch += pw < 0.05
    assert trend / len(rows) <= 0.07 and welch / len(rows) <= 0.07, (trend, welch)


def test_a_pooled_row_level_test_does_not_hold_its_size():
    # the flaw the step-level tests fix: ~5,500 verdicts treated as independent
    rows, hits = null_datasets(60, seed=1)
    x = np.arange(1, rows.shape[1] + 1, dtype=float)
    rejected = 0
    for n, k in zip(rows, hits):
        y = np.concatenate([np.r_[np.ones(a), np.zeros(b - a)] for a, b in zip(k, n)])
        _, _, p = logistic_trend(y, np.repeat(x, n))
        rejected += p is not None and p < 0.05
    assert rejected / len(rows) > 0.2


def test_a_real_trend_is_found():
    rng = np.random.default_rng(3)
    n = rng.integers(200, 800, size=11)
    rate = 0.6 + 0.02 * np.arange(11) + rng.normal(0, 0.02, 11)
    _, t, p = step_trend(rng.binomial(n, rate) / n, np.arange(11.0), n)
    assert t > 0 and p < 0.01


def test_welch_and_wls_against_scipy():
    a, b = np.array([0.7, 0.72, 0.69]), np.array([0.6, 0.66, 0.61, 0.64])
    t, p = welch_t(a, b)
    ref = stats.ttest_ind(b, a, equal_var=False)
    assert t == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue)
    y, x, w = np.array([0.5, 0.6, 0.55, 0.7, 0.8]), np.arange(5.0), np.array([1, 2, 3, 2, 1.0])
    slope, t, p = step_trend(y, x, w)
    X = np.column_stack([np.ones(5), x])
    W = np.diag(w)
    beta = np.linalg.solve(X.T @ W @ X, X.T @ W @ y)
    r = y - X @ beta
    s2 = (r @ W @ r) / 3
    se = np.sqrt(s2 * np.linalg.inv(X.T @ W @ X)[1, 1])
    assert slope == pytest.approx(beta[1]) and t == pytest.approx(beta[1] / se)
    assert p == pytest.approx(2 * stats.t.sf(abs(beta[1] / se), 3))
    assert step_trend(y[:2], x[:2]) == (None, None, None)


def _verdict_frames(agree_by_step, per_step=20):
    rows_s, rows_r, rolls = [], [], []
    for step, share in agree_by_step.items():
        for i in range(per_step):
            rid = f"r{step}-{i}"
            rolls.append({"rollout_id": rid, "group_id": f"g{step}", "task_id": "t",
                          "train_step": step})
            ok = i < round(share * per_step)
            rows_r.append({"rollout_id": rid, "criterion_id": "c", "verdict": "pass"})
            rows_s.append({"rollout_id": rid, "criterion_id": "c",
                           "verdict": "pass" if ok else "fail"})
    return pl.DataFrame(rows_s), pl.DataFrame(rows_r), pl.DataFrame(rolls).with_columns(
        pl.col("train_step").cast(pl.Int32))


def test_self_judge_audit_tests_per_step():
    shares = {1: 0.9, 2: 0.85, 3: 0.8, 4: 0.8, 5: 0.7, 6: 0.65, 7: 0.6, 8: 0.55}
    s, r, rolls = _verdict_frames(shares)
    _, tests = self_judge_audit(s, r, rolls)
    a = tests.filter(pl.col("metric") == "agreement")
    trend = a.filter(pl.col("test") == "wls_trend_per_step").row(0, named=True)
    want = stats.linregress(list(shares), list(shares.values()))  # equal rows: plain OLS
    assert trend["n_steps"] == 8 and trend["p_value"] == pytest.approx(want.pvalue)
    w = a.filter(pl.col("test") == "welch_t_first_vs_last_quarter").row(0, named=True)
    assert w["n_steps"] == 4
    assert w["p_value"] == pytest.approx(stats.ttest_ind([0.6, 0.55], [0.9, 0.85],
                                                         equal_var=False).pvalue)


def test_overlap_trend_tests_per_step():
    per_unit = pl.DataFrame({
        "unit": [f"u{i}" for i in range(10)], "n_own": [4] * 10, "n_reference": [5] * 10,
        "matched": [5, 4, 4, 3, 3, 2, 2, 2, 1, 1], "task_id": ["t"] * 10,
        "train_step": list(range(10))}).with_columns(pl.col("train_step").cast(pl.Int32))
    t = overlap_tests(per_unit)
    rec = t.filter((pl.col("metric") == "recall") & (pl.col("test") == "wls_trend_per_step"))
    want = stats.linregress(range(10), [m / 5 for m in per_unit["matched"]])
    assert rec["p_value"][0] == pytest.approx(want.pvalue) and rec["n_steps"][0] == 10
    assert set(t["metric"]) == {"recall", "precision"}
