"""CREDO (SPEC §6): rubric-predicted credit corrected by randomized execution replay.

plan     — square-root allocation of replay probabilities under a budget (Eq. 10), Bernoulli
           selection with a recorded seed; predictions stored before any label exists.
correct  — Ĉ_t = c_t + (S_t/p_t)(Δ_t − c_t) (Eq. 6), unbiased for any fixed c_t.
fit      — credit head (inverse-inclusion-weighted ridge) and error head (non-negative
           weighted regression of the squared residual), versioned.
evolve   — score candidate rubric edits by the held-out variance-weighted objective.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from draco_cli.errors import InputError, UsageError

DEFAULT_REPLAYS = 2


# --- allocation (Eq. 10) ------------------------------------------------------------------


@dataclass
class Allocation:
    p: np.ndarray
    lam: float
    spent: float  # Σ p_t ℓ_t
    slack: bool


def allocate(score_norm: np.ndarray, error: np.ndarray, cost: np.ndarray, budget: float,
             p_min: float = 0.05, tol: float = 1e-12) -> Allocation:
    """p_t = clip(‖g_t‖·sqrt(e_t/(λ ℓ_t)), p_min, 1) with Σ p_t ℓ_t ≤ budget.

    Slack budget (every position with e_t‖g_t‖ > 0 at 1, the rest at p_min, fits): that, with
    λ = 0 and the rest unspent. Otherwise λ by bisection so that Σ p_t ℓ_t = budget.
    """
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
    if (slack_p * c).sum() <= budget:
        return Allocation(slack_p, 0.0, float((slack_p * c).sum()), True)

    def p_of(lam: float) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = g * np.sqrt(e / (lam * c))
        return np.clip(np.nan_to_num(raw, nan=0.0), p_min, 1.0)

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
    """2·K·(T − t + 1): K replays on each side, each running the remaining T − t + 1 steps."""
    return 2.0 * replays * (n_steps - steps + 1)


def plan(positions: pl.DataFrame, budget: float, *, p_min: float = 0.05, seed: int = 0,
         replays: int = DEFAULT_REPLAYS, head_version: str | None = None) -> pl.DataFrame:
    """The replay plan: positions plus p, selected, lambda, seed (and head_version)."""
    for col in ("rollout_id", "step", "prediction", "error"):
        if col not in positions.columns:
            raise InputError("missing column of the positions table", field=col)
    pos = positions.with_columns(pl.col("step").cast(pl.Int64))
    for col in ("prediction", "error"):
        bad = pos.with_row_index("__r").filter(pl.col(col).is_null() | pl.col(col).is_nan())
        if bad.height:
            raise InputError("must be a number", row=int(bad["__r"][0]), field=col)
    if pos.select(pl.struct("rollout_id", "step").is_duplicated().any()).item():
        raise InputError("duplicate (rollout_id, step)", field="step")
    if "score_norm" not in pos.columns:
        pos = pos.with_columns(pl.lit(1.0).alias("score_norm"))
    if "cost" not in pos.columns:
        T = pos.group_by("rollout_id").agg(pl.col("step").max().alias("__T"))
        pos = pos.join(T, on="rollout_id", how="left", maintain_order="left")
        pos = pos.with_columns(pl.Series("cost", default_cost(
            pos["step"].to_numpy(), pos["__T"].to_numpy(), replays))).drop("__T")
    alloc = allocate(pos["score_norm"].to_numpy(), pos["error"].to_numpy(),
                     pos["cost"].to_numpy(), budget, p_min)
    rng = np.random.default_rng(seed)
    selected = rng.random(pos.height) < alloc.p
    return pos.with_columns(
        pl.Series("p", alloc.p), pl.Series("selected", selected),
        pl.lit(alloc.lam).alias("lambda"), pl.lit(seed).alias("seed"),
        pl.lit(head_version).cast(pl.String).alias("head_version"),
        pl.lit(budget).alias("budget"), pl.lit(alloc.spent).alias("expected_cost"))


# --- correction (Eq. 6) -------------------------------------------------------------------


def deltas(plan_df: pl.DataFrame, labels: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """Δ_t = mean realized return − mean resampled return for every selected position.
    Returns (rollout_id, step, delta) and the count of labels ignored (unselected positions)."""
    for col in ("rollout_id", "step", "side", "return"):
        if col not in labels.columns:
            raise InputError("missing column of the labels table", field=col)
    bad = labels.with_row_index("__r").filter(~pl.col("side").is_in(["realized", "resampled"]))
    if bad.height:
        raise InputError(f"side must be realized or resampled, got {bad['side'][0]!r}",
                         row=int(bad["__r"][0]), field="side")
    lab = labels.with_columns(pl.col("step").cast(pl.Int64))
    sel = plan_df.filter(pl.col("selected")).select("rollout_id", "step")
    ignored = lab.join(sel, on=["rollout_id", "step"], how="anti").height
    lab = lab.join(sel, on=["rollout_id", "step"], how="inner")
    sides = lab.group_by("rollout_id", "step").agg(
        pl.col("return").filter(pl.col("side") == "realized").mean().alias("real"),
        pl.col("return").filter(pl.col("side") == "resampled").mean().alias("res"))
    full = sel.join(sides, on=["rollout_id", "step"], how="left")
    missing = full.filter(pl.col("real").is_null() | pl.col("res").is_null())
    if missing.height:
        r = missing.row(0, named=True)
        side = "realized" if r["real"] is None else "resampled"
        raise InputError(f"selected position ({r['rollout_id']!r}, step {r['step']}) has no "
                         f"{side} labels ({missing.height} selected position(s) incomplete)",
                         field="side")
    return full.select("rollout_id", "step", (pl.col("real") - pl.col("res")).alias("delta")), \
        ignored


def rloo(rollouts: pl.DataFrame) -> pl.DataFrame:
    """Unstandardised RLOO of the outcome within each group: A_i = r_i − mean of the others."""
    r = pl.col("outcome")
    n = r.count().over("group_id")
    adv = pl.when(r.is_null() | (n <= 1)).then(0.0).otherwise(
        r - (r.sum().over("group_id") - r) / (n - 1))
    return rollouts.select("rollout_id", adv.alias("rloo"))


def correct(plan_df: pl.DataFrame, labels: pl.DataFrame, *, beta: float = 0.0,
            rollouts: pl.DataFrame | None = None, no_correction: bool = False,
            clip: float | None = None) -> tuple[pl.DataFrame, dict]:
    """Per-position corrected credit and advantage a_t = β·A_RLOO + (1 − β)·Ĉ_t."""
    if not 0 <= beta <= 1:
        raise UsageError("--beta must be in [0, 1]")
    if beta > 0 and rollouts is None:
        raise UsageError("--beta > 0 mixes in the rollouts' RLOO outcome: pass --rollouts")
    d, ignored = deltas(plan_df, labels)
    out = plan_df.select("rollout_id", pl.col("step").cast(pl.Int64), "prediction", "p",
                         "selected").join(d, on=["rollout_id", "step"], how="left",
                                          maintain_order="left")
    c, S, p, delta = pl.col("prediction"), pl.col("selected"), pl.col("p"), pl.col("delta")
    corrected = c if no_correction else pl.when(S).then(c + (delta - c) / p).otherwise(c)
    out = out.with_columns(corrected.alias("corrected"))
    if clip is not None:
        out = out.with_columns(pl.col("corrected").clip(-clip, clip))
    if beta > 0:
        out = out.join(rloo(rollouts), on="rollout_id", how="left", maintain_order="left") \
            .with_columns(pl.col("rloo").fill_null(0.0))
        out = out.with_columns((beta * pl.col("rloo") + (1 - beta) * pl.col("corrected"))
                               .alias("advantage"))
    else:
        out = out.with_columns(pl.lit(0.0).alias("rloo"), pl.col("corrected").alias("advantage"))
    info = {"labels_ignored": ignored, "selected": int(out["selected"].sum()),
            "positions": out.height, "correction": not no_correction, "clip": clip,
            "beta": beta}
    return out, info


# --- heads --------------------------------------------------------------------------------

DRACO_FEATURES = ["p", "f", "quality", "cited", "rel_position", "log_tokens", "reward"]


def draco_features(step_credit: pl.DataFrame, rewards: pl.DataFrame | None) -> pl.DataFrame:
    """Per-step features that carry across groups (ids are per group, so no per-criterion
    one-hot): p_j, f_j, Q_j, cited, t/T, log n_j and the rollout's reward."""
    sc = step_credit.with_columns(pl.col("step").cast(pl.Int64))
    T = sc.group_by("rollout_id").agg(pl.col("step").max().alias("__T"))
    sc = sc.join(T, on="rollout_id", how="left", maintain_order="left")
    if rewards is not None:
        sc = sc.join(rewards.select("rollout_id", "reward"), on="rollout_id", how="left",
                     maintain_order="left")
    else:
        sc = sc.with_columns(pl.lit(None, pl.Float64).alias("reward"))
    return sc.select(
        "rollout_id", "step",
        pl.col("p").cast(pl.Float64), pl.col("f").cast(pl.Float64),
        pl.col("quality").fill_null(0.5).alias("quality"),
        pl.col("cited").cast(pl.Float64),
        (pl.col("step") / pl.col("__T")).alias("rel_position"),
        pl.col("n_tokens").cast(pl.Float64).log().alias("log_tokens"),
        pl.col("reward").fill_null(0.5).alias("reward"))


def feature_columns(features: pl.DataFrame) -> list[str]:
    return [c for c in features.columns if c not in ("rollout_id", "step", "task_id")
            and features[c].dtype.is_numeric()]


def weighted_ridge(X: np.ndarray, y: np.ndarray, w: np.ndarray, ridge: float) -> np.ndarray:
    """argmin Σ w_i (y_i − [1, x_i]·β)² + ridge·|β_{1:}|² (intercept not penalised)."""
    A = np.column_stack([np.ones(len(X)), X])
    P = np.eye(A.shape[1]) * ridge
    P[0, 0] = 0.0
    return np.linalg.solve(A.T @ (A * w[:, None]) + P, A.T @ (w * y))


def nonneg_weighted(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Non-negative weighted least squares on [1, |x|] (predictions are then ≥ 0)."""
    from scipy.optimize import nnls

    A = np.column_stack([np.ones(len(X)), np.abs(X)])
    sw = np.sqrt(w)
    coef, _ = nnls(A * sw[:, None], y * sw)
    return coef


@dataclass
class Heads:
    features: list[str]
    credit: list[float]
    error: list[float]
    ridge: float
    version: str
    rows: int

    def predict(self, F: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        X = F.select(self.features).fill_null(0.0).to_numpy().astype(float)
        c = np.column_stack([np.ones(len(X)), X]) @ np.asarray(self.credit)
        e = np.column_stack([np.ones(len(X)), np.abs(X)]) @ np.asarray(self.error)
        return c, np.maximum(e, 0.0)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "heads") -> "Heads":
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as exc:
            raise InputError(f"not a draco heads file ({exc})", file=source) from None


def _training_rows(plan_df: pl.DataFrame, labels: pl.DataFrame, features: pl.DataFrame
                   ) -> pl.DataFrame:
    d, _ = deltas(plan_df, labels)
    rows = plan_df.filter(pl.col("selected")).select(
        "rollout_id", pl.col("step").cast(pl.Int64), "p", "prediction").join(
        d, on=["rollout_id", "step"]).join(
        features.with_columns(pl.col("step").cast(pl.Int64)), on=["rollout_id", "step"],
        how="inner")
    if rows.height == 0:
        raise InputError("no selected position has both labels and features", field="step")
    return rows


def fit_heads(plan_df: pl.DataFrame, labels: pl.DataFrame, features: pl.DataFrame,
              ridge: float = 1.0, names: list[str] | None = None) -> Heads:
    """Credit head: inverse-inclusion-weighted ridge of Δ on features. Error head:
    non-negative weighted regression of (Δ − c_old)², c_old the plan's stored prediction."""
    names = names or feature_columns(features)
    rows = _training_rows(plan_df, labels, features)
    X = rows.select(names).fill_null(0.0).to_numpy().astype(float)
    w = 1.0 / rows["p"].to_numpy()
    delta = rows["delta"].to_numpy()
    credit = weighted_ridge(X, delta, w, ridge)
    resid2 = (delta - rows["prediction"].to_numpy()) ** 2
    error = nonneg_weighted(X, resid2, w)
    digest = hashlib.sha256(json.dumps([names, credit.tolist(), error.tolist(), ridge])
                            .encode()).hexdigest()[:12]
    return Heads(names, credit.tolist(), error.tolist(), ridge, f"heads-{digest}", rows.height)


def task_split(rollouts: pl.DataFrame, holdout: float = 0.2) -> tuple[set, set]:
    """Tasks split deterministically by hash: (train rollout ids, held-out rollout ids)."""
    def held(task: str) -> bool:
        return int(hashlib.sha256(str(task).encode()).hexdigest(), 16) % 1000 < holdout * 1000

    r = rollouts.select("rollout_id", "task_id").with_columns(
        pl.col("task_id").map_elements(held, return_dtype=pl.Boolean).alias("__held"))
    return set(r.filter(~pl.col("__held"))["rollout_id"]), set(r.filter(pl.col("__held"))
                                                              ["rollout_id"])


def objective(rows: pl.DataFrame, c: np.ndarray) -> tuple[float, float]:
    """(variance-weighted objective Σ (S/p)((1−p)/p)‖g‖²(Δ − c)², ordinary MSE) over selected
    held-out rows (S = 1 there)."""
    p = rows["p"].to_numpy()
    g = rows["score_norm"].to_numpy() if "score_norm" in rows.columns else np.ones_like(p)
    r2 = (rows["delta"].to_numpy() - c) ** 2
    return float(np.sum((1 / p) * ((1 - p) / p) * g ** 2 * r2)), float(np.mean(r2))


def calibration(heads: Heads, rows: pl.DataFrame, bins: int = 5) -> pl.DataFrame:
    c, _ = heads.predict(rows)
    df = pl.DataFrame({"pred": c, "delta": rows["delta"].to_numpy(), "w": 1 / rows["p"].to_numpy()})
    if df.height == 0:
        return pl.DataFrame(schema={"bin": pl.Int64, "n": pl.Int64, "mean_prediction": pl.Float64,
                                    "mean_delta": pl.Float64})
    df = df.with_columns(pl.col("pred").qcut(min(bins, df.height), labels=None,
                                             allow_duplicates=True).to_physical().alias("bin"))
    return df.group_by("bin").agg(pl.len().alias("n"),
                                  ((pl.col("pred") * pl.col("w")).sum() / pl.col("w").sum())
                                  .alias("mean_prediction"),
                                  ((pl.col("delta") * pl.col("w")).sum() / pl.col("w").sum())
                                  .alias("mean_delta")).sort("bin").with_columns(
        pl.col("bin").cast(pl.Int64))


def evolve(plan_df: pl.DataFrame, labels: pl.DataFrame, rollouts: pl.DataFrame,
           candidates: dict[str, pl.DataFrame], ridge: float = 1.0, holdout: float = 0.2
           ) -> pl.DataFrame:
    """Score rubric variants (each a features table computed under one rubric edit; 'baseline'
    is the current rubric): fit the credit head on training tasks, evaluate on held-out tasks.
    Lower objective is better; accept the best only if it beats the baseline."""
    train, held = task_split(rollouts, holdout)
    out = []
    for name, F in candidates.items():
        rows = _training_rows(plan_df, labels, F)
        tr = rows.filter(pl.col("rollout_id").is_in(list(train)))
        te = rows.filter(pl.col("rollout_id").is_in(list(held)))
        if tr.height == 0 or te.height == 0:
            raise UsageError("the task split left no labelled position on one side; label more "
                             "positions or change --holdout")
        h = fit_heads(plan_df.filter(pl.col("rollout_id").is_in(list(train))), labels, F, ridge)
        c, _ = h.predict(te)
        obj, mse = objective(te.join(plan_df.select("rollout_id", pl.col("step").cast(pl.Int64),
                                                    "score_norm"), on=["rollout_id", "step"],
                                     how="left") if "score_norm" in plan_df.columns else te, c)
        out.append({"candidate": name, "held_out_objective": obj, "held_out_mse": mse,
                    "train_rows": tr.height, "held_out_rows": te.height})
    df = pl.DataFrame(out).sort("held_out_objective")
    base = df.filter(pl.col("candidate") == "baseline")
    best = df.row(0, named=True)
    accept = base.height == 0 or best["held_out_objective"] < base["held_out_objective"][0]
    return df.with_columns(((pl.col("candidate") == best["candidate"]) & pl.lit(accept))
                           .alias("accepted"))
