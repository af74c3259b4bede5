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
    """K·(T − t + 1) + K·(T − t) environment actions (SPEC §6): the resampled side runs a fresh
    action and the remaining steps, the realized side restores the state after step t and runs
    the remaining T − t."""
    return replays * (2.0 * (n_steps - steps) + 1.0)


ALLOCATIONS = ("sqrt", "uniform")


def rollout_lengths(steps: pl.DataFrame) -> pl.DataFrame:
    """T per rollout from a steps table: its number of steps (rollout_id, n_steps)."""
    for col in ("rollout_id", "step"):
        if col not in steps.columns:
            raise InputError("missing column of the steps table", field=col)
    return steps.group_by("rollout_id").agg(pl.col("step").cast(pl.Int64).max()
                                            .alias("n_steps"))


def _with_cost(pos: pl.DataFrame, replays: int, n_steps: pl.DataFrame | None) -> pl.DataFrame:
    if "cost" in pos.columns:
        return pos
    if "n_steps" not in pos.columns:
        if n_steps is None:
            raise UsageError("the default replay cost needs each rollout's number of steps T: "
                             "pass the steps table (--steps), or give the positions an "
                             "n_steps or cost column (the largest listed step is not T when "
                             "only some steps are listed)")
        pos = pos.join(n_steps.select("rollout_id", pl.col("n_steps").cast(pl.Int64)),
                       on="rollout_id", how="left", maintain_order="left")
    idx = pos.with_row_index("__r")
    bad = idx.filter(pl.col("n_steps").is_null())
    if bad.height:
        raise InputError(f"rollout {bad['rollout_id'][0]!r} has no number of steps T (not in "
                         "the steps table)", row=int(bad["__r"][0]), field="n_steps")
    bad = idx.filter((pl.col("step") < 1) | (pl.col("step") > pl.col("n_steps")))
    if bad.height:
        r = bad.row(0, named=True)
        raise InputError(f"step {r['step']} is outside 1..T = 1..{r['n_steps']} of rollout "
                         f"{r['rollout_id']!r}", row=int(r["__r"]), field="step")
    return pos.with_columns(pl.Series("cost", default_cost(
        pos["step"].to_numpy(), pos["n_steps"].to_numpy(), replays)))


def plan(positions: pl.DataFrame, budget: float, *, p_min: float = 0.05, seed: int = 0,
         replays: int = DEFAULT_REPLAYS, head_version: str | None = None,
         n_steps: pl.DataFrame | None = None, allocation: str = "sqrt") -> pl.DataFrame:
    """The replay plan: positions plus p, selected, lambda, seed (and head_version).

    `allocation="uniform"` gives every position the same p at the expected cost the
    square-root plan spends under the same budget (the paper's uniform-replay arm)."""
    if allocation not in ALLOCATIONS:
        raise UsageError(f"--allocation takes sqrt or uniform, not {allocation!r}")
    if replays < 1:
        raise UsageError("--replays must be at least 1")
    for col in ("rollout_id", "step", "prediction", "error"):
        if col not in positions.columns:
            raise InputError("missing column of the positions table", field=col)
    if positions.height == 0:
        raise InputError("the positions table has no rows: nothing to plan", field="rollout_id")
    pos = positions.with_columns(pl.col("step").cast(pl.Int64))
    for col in ("prediction", "error"):
        bad = pos.with_row_index("__r").filter(pl.col(col).is_null() | pl.col(col).is_nan())
        if bad.height:
            raise InputError("must be a number", row=int(bad["__r"][0]), field=col)
    if pos.select(pl.struct("rollout_id", "step").is_duplicated().any()).item():
        raise InputError("duplicate (rollout_id, step)", field="step")
    if "score_norm" not in pos.columns:
        pos = pos.with_columns(pl.lit(1.0).alias("score_norm"))
    pos = _with_cost(pos, replays, n_steps)
    cost = pos["cost"].to_numpy()
    alloc = allocate(pos["score_norm"].to_numpy(), pos["error"].to_numpy(), cost, budget, p_min)
    if allocation == "uniform":
        p_uni = min(1.0, max(p_min, alloc.spent / float(cost.sum())))
        alloc = Allocation(np.full(pos.height, p_uni), 0.0, p_uni * float(cost.sum()),
                           alloc.slack)
    rng = np.random.default_rng(seed)
    selected = rng.random(pos.height) < alloc.p
    return pos.with_columns(
        pl.Series("p", alloc.p), pl.Series("selected", selected),
        pl.lit(alloc.lam).alias("lambda"), pl.lit(seed).alias("seed"),
        pl.lit(head_version).cast(pl.String).alias("head_version"),
        pl.lit(budget).alias("budget"), pl.lit(alloc.spent).alias("expected_cost"),
        pl.lit(allocation).alias("allocation"), pl.lit(replays).alias("replays"))


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
    if "sample" in lab.columns:
        key = ["rollout_id", "step", "side", "sample"]
        clash = lab.with_row_index("__r").group_by(key).agg(
            pl.col("return").n_unique().alias("__v"), pl.col("__r").min()).filter(
            pl.col("__v") > 1)
        if clash.height:
            r = clash.sort("__r").row(0, named=True)
            raise InputError(f"conflicting duplicate labels: ({r['rollout_id']!r}, step "
                             f"{r['step']}, {r['side']}, sample {r['sample']}) has different "
                             f"returns ({clash.height} such key(s))", row=int(r["__r"]),
                             field="return")
        lab = lab.unique(subset=key, keep="first", maintain_order=True)
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
    if clip is not None and not clip > 0:
        raise UsageError(f"--clip must be > 0 (got {clip:g}): Ĉ_t is clipped to ±CLIP")
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
    """Held-out calibration of both heads, inverse-inclusion weighted, per prediction bin:
    credit head (mean prediction c vs mean Δ) and error head (mean predicted e vs mean
    (Δ − c_old)², c_old the plan's stored prediction — the error head's own target)."""
    schema = {"head": pl.String, "bin": pl.Int64, "n": pl.Int64, "mean_prediction": pl.Float64,
              "mean_target": pl.Float64}
    if rows.height == 0:
        return pl.DataFrame(schema=schema)
    c, e = heads.predict(rows)
    delta = rows["delta"].to_numpy()
    w = 1 / rows["p"].to_numpy()
    parts = []
    for head, pred, target in (("credit", c, delta),
                               ("error", e, (delta - rows["prediction"].to_numpy()) ** 2)):
        df = pl.DataFrame({"pred": pred, "target": target, "w": w})
        df = df.with_columns(pl.col("pred").rank("ordinal").sub(1).mul(min(bins, df.height))
                             .floordiv(df.height).cast(pl.Int64).alias("bin"))
        parts.append(df.group_by("bin").agg(
            pl.len().cast(pl.Int64).alias("n"),
            ((pl.col("pred") * pl.col("w")).sum() / pl.col("w").sum()).alias("mean_prediction"),
            ((pl.col("target") * pl.col("w")).sum() / pl.col("w").sum()).alias("mean_target"))
            .sort("bin").select(pl.lit(head).alias("head"), "bin", "n", "mean_prediction",
                                "mean_target"))
    return pl.concat(parts).cast(schema)


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
    te = _training_rows(held_plan, labels, features)
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
