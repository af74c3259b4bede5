"""The heads (SPEC §6; docs/credo.md, "Heads"): the credit head c and the error head e,
versioned; held-out calibration and cross-fitting, both split by task."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from draco_cli.credo.correction import deltas
from draco_cli.errors import InputError, UsageError

DRACO_FEATURES = ["p", "f", "quality", "cited", "rel_position", "log_tokens", "reward"]


def draco_features(step_credit: pl.DataFrame, rewards: pl.DataFrame | None) -> pl.DataFrame:
    """Per-step features that carry across groups (ids are per group, so no per-criterion
    one-hot): p_j, f_j, Q_j, cited, t/T, log n_j and the rollout's reward."""
    sc = step_credit.with_columns(pl.col("step").cast(pl.Int64))
    T = sc.group_by("rollout_id").agg(pl.col("step").max().alias("__T"))
    sc = sc.join(T, on="rollout_id", how="left", maintain_order="left")
    reward = []
    if rewards is not None:
        sc = sc.join(rewards.select("rollout_id", "reward"), on="rollout_id", how="left",
                     maintain_order="left")
        reward = [pl.col("reward").fill_null(0.5).alias("reward")]
    # without rewards there is no reward feature (not a constant stand-in): heads fitted with
    # it refuse features without it instead of predicting something else silently
    return sc.select(
        "rollout_id", "step",
        pl.col("p").cast(pl.Float64), pl.col("f").cast(pl.Float64),
        pl.col("quality").fill_null(0.5).alias("quality"),
        pl.col("cited").cast(pl.Float64),
        (pl.col("step") / pl.col("__T")).alias("rel_position"),
        pl.col("n_tokens").cast(pl.Float64).log().alias("log_tokens"), *reward)


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
        absent = [f for f in self.features if f not in F.columns]
        if absent:
            hint = (" (the reward feature comes from rewards.parquet: pass --rewards)"
                    if "reward" in absent else "")
            raise InputError(f"the heads ({self.version}) use feature(s) {', '.join(absent)} "
                             f"that the features table lacks{hint}", field=absent[0])
        X = F.select(self.features).fill_null(0.0).to_numpy().astype(float)
        c = np.column_stack([np.ones(len(X)), X]) @ np.asarray(self.credit)
        e = np.column_stack([np.ones(len(X)), np.abs(X)]) @ np.asarray(self.error)
        return c, np.maximum(e, 0.0)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "heads") -> Heads:
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as exc:
            raise InputError(f"not a draco heads file ({exc})", file=source) from None


def training_rows(plan_df: pl.DataFrame, labels: pl.DataFrame, features: pl.DataFrame
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
    rows = training_rows(plan_df, labels, features)
    X = rows.select(names).fill_null(0.0).to_numpy().astype(float)
    w = 1.0 / rows["p"].to_numpy()
    delta = rows["delta"].to_numpy()
    credit = weighted_ridge(X, delta, w, ridge)
    resid2 = (delta - rows["prediction"].to_numpy()) ** 2
    error = nonneg_weighted(X, resid2, w)
    digest = hashlib.sha256(json.dumps([names, credit.tolist(), error.tolist(), ridge])
                            .encode()).hexdigest()[:12]
    return Heads(names, credit.tolist(), error.tolist(), ridge, f"heads-{digest}", rows.height)


def task_split(rollouts: pl.DataFrame, holdout: float = 0.2) -> tuple[set[str], set[str]]:
    """Tasks split deterministically by hash: (train rollout ids, held-out rollout ids)."""
    def held(task: str) -> bool:
        return int(hashlib.sha256(str(task).encode()).hexdigest(), 16) % 1000 < holdout * 1000

    r = rollouts.select("rollout_id", "task_id").with_columns(
        pl.col("task_id").map_elements(held, return_dtype=pl.Boolean).alias("__held"))
    return set(r.filter(~pl.col("__held"))["rollout_id"]), set(r.filter(pl.col("__held"))
                                                              ["rollout_id"])


def calibration(heads: Heads, rows: pl.DataFrame, bins: int = 5) -> pl.DataFrame:
    """Held-out calibration of both heads, inverse-inclusion weighted, per prediction bin:
    credit head (mean prediction c vs mean Δ) and error head (mean predicted e vs mean
    (Δ − c_old)², c_old the plan's stored prediction — the error head's own target)."""
    schema = pl.Schema({"head": pl.String, "bin": pl.Int64, "n": pl.Int64,
                        "mean_prediction": pl.Float64, "mean_target": pl.Float64})
    if rows.height == 0:
        return pl.DataFrame(schema=schema)
    c, e = heads.predict(rows)
    delta = rows["delta"].to_numpy()
    w = 1 / rows["p"].to_numpy()
    return pl.concat([
        weighted_bins(pred, target, w, bins).select(pl.lit(head).alias("head"), pl.all())
        for head, pred, target in (("credit", c, delta),
                                   ("error", e, (delta - rows["prediction"].to_numpy()) ** 2))
    ]).cast(schema)


def weighted_bins(pred: Any, target: Any, w: Any, bins: int) -> pl.DataFrame:
    """bin, n, mean_prediction, mean_target: ``bins`` equal-count bins of ``pred`` (at most
    one per row), each mean weighted by ``w`` (inverse inclusion probabilities)."""
    df = pl.DataFrame({"pred": pred, "target": target, "w": w})
    df = df.with_columns(pl.col("pred").rank("ordinal").sub(1).mul(min(bins, df.height))
                         .floordiv(df.height).cast(pl.Int64).alias("bin"))
    return df.group_by("bin").agg(
        pl.len().cast(pl.Int64).alias("n"),
        ((pl.col("pred") * pl.col("w")).sum() / pl.col("w").sum()).alias("mean_prediction"),
        ((pl.col("target") * pl.col("w")).sum() / pl.col("w").sum()).alias("mean_target"),
    ).sort("bin")


def fit_with_holdout(plan_df: pl.DataFrame, labels: pl.DataFrame, features: pl.DataFrame,
                     rollouts: pl.DataFrame, ridge: float = 1.0, holdout: float = 0.2
                     ) -> tuple[Heads, pl.DataFrame | None, str]:
    """Heads fitted on training tasks, calibrated on held-out tasks (split by task). Returns
    (heads, calibration table or None, a one-line note saying what was held out or why no
    calibration could be computed)."""
    train, held = task_split(rollouts, holdout)
    h = fit_heads(plan_df.filter(pl.col("rollout_id").is_in(list(train))), labels, features,
                  ridge)
    held_plan = plan_df.filter(pl.col("rollout_id").is_in(list(held)))
    if held_plan.filter(pl.col("selected")).height == 0:
        return h, None, (f"no held-out calibration: the split by task held out {len(held)} "
                         "rollout(s), none with a replayed position (label more positions or "
                         "raise --holdout)")
    te = training_rows(held_plan, labels, features)
    return h, calibration(h, te), (f"held-out calibration on {te.height} replayed position(s) "
                                   f"of {len(held)} held-out rollout(s), split by task")


def cross_fit(plan_df: pl.DataFrame, labels: pl.DataFrame, features: pl.DataFrame,
              rollouts: pl.DataFrame, folds: int = 5, ridge: float = 1.0) -> pl.DataFrame:
    """Cross-fitted predictions: tasks split into `folds` folds by hash; every position of a
    fold gets c and e from heads fitted on the other folds only, so no prediction was fitted
    on its own label. Returns rollout_id, step, prediction, error, fold, head_version."""
    if folds < 2:
        raise UsageError("--cross-fit needs at least 2 folds")
    fold_of = rollouts.select("rollout_id", pl.col("task_id").map_elements(
        lambda t: int(hashlib.sha256(str(t).encode()).hexdigest(), 16) % folds,
        return_dtype=pl.Int64).alias("fold"))
    F = features.with_columns(pl.col("step").cast(pl.Int64)).join(fold_of, on="rollout_id",
                                                                   how="inner")
    parts = []
    for k in range(folds):
        others = fold_of.filter(pl.col("fold") != k)["rollout_id"].to_list()
        part = F.filter(pl.col("fold") == k)
        if part.height == 0:
            continue
        h = fit_heads(plan_df.filter(pl.col("rollout_id").is_in(others)), labels, features,
                      ridge)
        c, e = h.predict(part)
        parts.append(part.select("rollout_id", "step", pl.Series("prediction", c),
                                 pl.Series("error", e), "fold",
                                 pl.lit(h.version).alias("head_version")))
    return pl.concat(parts)
