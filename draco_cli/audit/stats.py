"""Small statistical tests the audits report (numpy/scipy only)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as st


# --- tests at the level the data is independent: one observation per train step ------------


def welch_t(a: np.ndarray, b: np.ndarray) -> tuple[float | None, float | None]:
    """Welch's two-sample t-test of b against a (each value one train step's rate): (t, p).
    None with fewer than 2 values on a side or no variance on either."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.size < 2 or b.size < 2:
        return None, None
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    if va + vb <= 0:
        return None, None
    t = (b.mean() - a.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va ** 2 / (a.size - 1) if va else 0) +
                           (vb ** 2 / (b.size - 1) if vb else 0))
    return float(t), float(2 * st.t.sf(abs(t), df))


def step_trend(rate: np.ndarray, x: np.ndarray, weight: np.ndarray | None = None
               ) -> tuple[float | None, float | None, float | None]:
    """Weighted least-squares slope of per-step rates on x (each step one observation,
    weighted by its row count) and its t-test on S − 2 degrees of freedom: (slope, t, p).
    None with fewer than 3 steps or a constant x; t and p None on a perfect fit."""
    y, x = np.asarray(rate, dtype=float), np.asarray(x, dtype=float)
    w = np.ones_like(y) if weight is None else np.asarray(weight, dtype=float)
    ok = np.isfinite(y) & (w > 0)
    y, x, w = y[ok], x[ok], w[ok]
    if y.size < 3 or np.all(x == x[0]):
        return None, None, None
    w = w / w.mean()
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    sxx = float(np.sum(w * (x - xm) ** 2))
    slope = float(np.sum(w * (x - xm) * (y - ym)) / sxx)
    resid = y - ym - slope * (x - xm)
    s2 = float(np.sum(w * resid ** 2)) / (y.size - 2)
    if s2 <= 0:
        return slope, None, None
    t = slope / math.sqrt(s2 / sxx)
    return slope, float(t), float(2 * st.t.sf(abs(t), y.size - 2))


def quarters(train_steps: list[int]) -> tuple[list[int], list[int]]:
    """First and last ⌈S/4⌉ distinct train steps."""
    s = sorted(set(train_steps))
    q = math.ceil(len(s) / 4)
    return s[:q], s[-q:] if q else []


def step_tests(metric: str, per_step: list[tuple[int, float | None, int]]
               ) -> list[dict[str, object]]:
    """Both step-level tests of one figure from (train_step, rate, rows) per step, as rows of
    the tests tables (metric, test, statistic, p_value, n_steps); the quarters are those of
    the steps listed."""
    first, last = quarters([s for s, _, _ in per_step])
    rows = [(s, r, n) for s, r, n in per_step if r is not None and n > 0]
    a = np.array([r for s, r, _ in rows if s in first])
    b = np.array([r for s, r, _ in rows if s in last])
    t, p = welch_t(a, b)
    _, tt, pt = step_trend(np.array([r for _, r, _ in rows]), np.array([s for s, _, _ in rows]),
                           np.array([n for *_, n in rows]))
    # the steps in either quarter, each once (with one step, both quarters are that step)
    in_quarters = {s for s, _, _ in rows if s in first or s in last}
    return [{"metric": metric, "test": test, "statistic": stat, "p_value": pv, "n_steps": n}
            for test, stat, pv, n in (("welch_t_first_vs_last_quarter", t, p, len(in_quarters)),
                                      ("wls_trend_per_step", tt, pt, len(rows)))]


@dataclass
class Trend:
    slope: float | None
    t: float | None
    p: float | None


def trend(per_step: list[tuple[int, float | None, int]]) -> Trend:
    """The step-level trend of one rate from (train_step, rate, weight) per step: weighted
    least-squares slope and its t-test (``step_trend``). A perfect linear fit over ≥ 3 steps
    (no residual variance) has t = ±∞ and p = 0, the test's limit; a constant rate has slope
    0 and p = 1."""
    rows = [(s, r, w) for s, r, w in per_step if r is not None and w > 0]
    slope, t, p = step_trend(np.array([r for _, r, _ in rows], dtype=float),
                             np.array([s for s, _, _ in rows], dtype=float),
                             np.array([w for *_, w in rows], dtype=float))
    if slope is None or t is not None:
        return Trend(slope, t, p)
    if slope == 0:
        return Trend(0.0, 0.0, 1.0)
    return Trend(slope, math.copysign(math.inf, slope), 0.0)
