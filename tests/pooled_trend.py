"""The pooled row-level trend test the audits no longer use (every verdict taken as an
independent observation): kept for the tests that show why (tests/test_trend_size.py)."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as st


def logistic_trend(y: np.ndarray, x: np.ndarray, max_iter: int = 100
                   ) -> tuple[float | None, float | None, float | None]:
    """Logistic regression of a 0/1 indicator on x by IRLS; Wald test of the slope:
    (slope, z, p). None when undefined (constant y or x, or separation)."""
    y = np.asarray(y, dtype=float)
    x = np.asarray(x, dtype=float)
    if y.size < 3 or np.all(y == y[0]) or np.all(x == x[0]):
        return None, None, None
    xs = (x - x.mean()) / x.std()  # standardise for a well-conditioned fit
    X = np.column_stack([np.ones_like(xs), xs])
    beta = np.zeros(2)
    for _ in range(max_iter):
        eta = X @ beta
        mu = 1 / (1 + np.exp(-eta))
        w = mu * (1 - mu)
        if np.any(w < 1e-12):
            w = np.maximum(w, 1e-12)
        H = X.T @ (X * w[:, None])
        step = np.linalg.solve(H, X.T @ (y - mu))
        beta = beta + step
        if np.max(np.abs(step)) < 1e-10:
            break
        if np.max(np.abs(beta)) > 30:  # (quasi-)separation: the MLE does not exist
            return None, None, None
    mu = 1 / (1 + np.exp(-(X @ beta)))
    cov = np.linalg.inv(X.T @ (X * (mu * (1 - mu))[:, None]))
    se = math.sqrt(cov[1, 1])
    z = beta[1] / se
    slope = beta[1] / x.std()  # per unit of x
    return float(slope), float(z), float(2 * st.norm.sf(abs(z)))
