"""Where credit lands, against labelled steps (SPEC §4, ``draco audit step-labels``).

Sources, figures and intervals: see docs/audits.md. Pure functions over polars frames; numpy
does the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from draco_cli.schemas import StepLabelFigure, polars_schema

FIGURES = ("auroc_quality", "bad_mass", "good_mass", "worst_step_hit")
TIE = 1e-12  # qualities this close count as tied (Q̄ is a mean of fractions)


@dataclass
class RunCredit:
    """What an audited draco run gives: its advantages, step credit and verdicts."""

    rewards: pl.DataFrame  # rollout_id, advantage
    step_credit: pl.DataFrame  # rollout_id, step, quality, total
    verdicts: pl.DataFrame | None = None  # rollout_id, verdict, cited_steps, retained


@dataclass
class Frame:
    """The audited steps in (rollout, step) order, as arrays."""

    rollout_id: np.ndarray  # str per step
    step: np.ndarray
    r: np.ndarray  # rollout code per step
    g: np.ndarray  # group code per step
    n: np.ndarray  # tokens
    adv: np.ndarray  # A_i of the step's rollout
    h: np.ndarray  # human label, nan where unlabelled
    n_rollouts: int
    n_groups: int
    zero_adv: int  # rollouts with A_i = 0


def outcome_advantage(rollouts: pl.DataFrame) -> pl.DataFrame:
    """A_i of outcome GRPO (SPEC §3.5 on the environment's outcome): rollout_id, advantage."""
    from draco_cli.credit.core import group_advantage

    r = rollouts.select("rollout_id", "group_id", pl.col("outcome").alias("reward"))
    return r.select("rollout_id").with_columns(group_advantage(r))


def frame(steps: pl.DataFrame, rollouts: pl.DataFrame, human: pl.DataFrame,
          advantage: pl.DataFrame) -> Frame:
    """The steps of the rollouts that have human labels and an advantage."""
    labelled = human.select("rollout_id").unique()
    s = (steps.select("rollout_id", "step", "n_tokens")
         .join(labelled, on="rollout_id")
         .join(rollouts.select("rollout_id", "group_id"), on="rollout_id")
         .join(advantage.select("rollout_id", "advantage"), on="rollout_id")
         .join(human.select("rollout_id", "step", "label"), on=["rollout_id", "step"],
               how="left")
         .sort("rollout_id", "step"))
    r = s["rollout_id"].to_numpy()
    _, r_code = np.unique(r, return_inverse=True)
    _, g_code = np.unique(s["group_id"].to_numpy(), return_inverse=True)
    adv = s["advantage"].fill_null(0.0).to_numpy().astype(float)
    first = np.r_[True, r_code[1:] != r_code[:-1]] if len(r_code) else np.zeros(0, bool)
    return Frame(r, s["step"].to_numpy(), r_code, g_code,
                 s["n_tokens"].to_numpy().astype(float), adv,
                 s["label"].cast(pl.Float64).fill_null(np.nan).to_numpy(),
                 int(r_code.max() + 1) if len(r_code) else 0,
                 int(g_code.max() + 1) if len(g_code) else 0, int((adv[first] == 0).sum()))


# --- credit sources -------------------------------------------------------------------------


def draco_credit(f: Frame, p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q_ij, t_ij) of SPEC §3.6 from per-step pass / fail counts p, q, by the credit stage's
    own computation: a rollout with nothing cited falls back to GRPO (Q null, t = n·A)."""
    from draco_cli.credit.core import step_credit_arrays
    from draco_cli.credit.inputs import StepArrays

    offsets = np.r_[0, np.cumsum(np.bincount(f.r, minlength=f.n_rollouts))]
    n = f.n.astype(np.int64)
    sa = StepArrays(pl.Series(dtype=pl.String), f.r, f.step, n, n, offsets)
    out = step_credit_arrays(sa, p, q, f.adv[offsets[:-1]])
    return out["quality"], f.n * out["advantage"]


def label_counts(f: Frame, labels: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per-step (p, q): a labeler's +1 / −1 on the step, each one criterion citing it."""
    key = pl.DataFrame({"rollout_id": f.rollout_id, "step": f.step})
    lab = key.join(labels.select("rollout_id", "step", "label"), on=["rollout_id", "step"],
                   how="left")["label"].fill_null(0).to_numpy()
    return (lab == 1).astype(float), (lab == -1).astype(float)


def random_counts(f: Frame, verdicts: list[tuple[int, bool, int]], seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The random-citation control: each (rollout code, passed, k citations) verdict cites k
    distinct steps of its rollout drawn uniformly (seeded)."""
    rng = np.random.default_rng(seed)
    starts = np.searchsorted(f.r, np.arange(f.n_rollouts))
    M = np.bincount(f.r, minlength=f.n_rollouts)
    p, q = np.zeros(len(f.r)), np.zeros(len(f.r))
    for r, passed, k in verdicts:
        k = min(k, int(M[r]))
        if k <= 0:
            continue
        at = starts[r] + rng.choice(int(M[r]), size=k, replace=False)
        (p if passed else q)[at] += 1
    return p, q


def run_verdicts(f: Frame, verdicts: pl.DataFrame) -> list[tuple[int, bool, int]]:
    """The run's retained pass / fail verdicts as (rollout code, passed, citations)."""
    code = dict(zip(f.rollout_id.tolist(), f.r.tolist()))
    v = verdicts.filter(pl.col("verdict").is_in(["pass", "fail"]))
    if "retained" in v.columns:
        v = v.filter(pl.col("retained").fill_null(False))
    out = []
    for rid, verdict, cited in v.select("rollout_id", "verdict", "cited_steps").iter_rows():
        if rid in code:
            out.append((code[rid], verdict == "pass", len(cited or [])))
    return out


def run_credit(f: Frame, step_credit: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(Q, t) as the run wrote them in step_credit."""
    key = pl.DataFrame({"rollout_id": f.rollout_id, "step": f.step})
    sc = key.join(step_credit.select("rollout_id", "step", "quality", "total"),
                  on=["rollout_id", "step"], how="left")
    Q = sc["quality"].cast(pl.Float64).fill_null(np.nan).to_numpy()
    t = sc["total"].cast(pl.Float64).fill_null(0.0).to_numpy()
    return Q, t


# --- figures --------------------------------------------------------------------------------


def _by_group(f: Frame, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.bincount(f.g[mask], values[mask], f.n_groups)


def _auroc_parts(f: Frame, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(C[g, h] = Σ over +1 steps of g and −1 steps of h of [Q_good > Q_bad] + ½[tie],
    +1 steps per group, −1 steps per group)."""
    ok = np.isfinite(Q)
    good, bad = ok & (f.h == 1), ok & (f.h == -1)
    G = f.n_groups
    qg, gg = Q[good], f.g[good]
    qb, gb = Q[bad], f.g[bad]
    C = np.zeros((G, G))
    chunk = max(1, 2_000_000 // max(len(qg), 1))
    for a in range(0, len(qb), chunk):
        diff = qg[:, None] - qb[None, a:a + chunk]
        s = (diff > TIE) + 0.5 * (np.abs(diff) <= TIE)
        rows = np.zeros((G, s.shape[1]))
        np.add.at(rows, gg, s)
        np.add.at(C.T, gb[a:a + chunk], rows.T)
    return C, np.bincount(gg, minlength=G).astype(float), np.bincount(gb, minlength=G)\
        .astype(float)


def _worst_parts(f: Frame, Q: np.ndarray, constant: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per group (Σ hit share, rollouts) over rollouts with a −1 and a +1 labelled step."""
    R = f.n_rollouts
    lab = np.isfinite(f.h)
    has_bad = np.bincount(f.r, lab & (f.h == -1), R) > 0
    has_good = np.bincount(f.r, lab & (f.h == 1), R) > 0
    q = np.zeros_like(Q) if constant else Q
    missing = np.bincount(f.r, lab & ~np.isfinite(q), R) > 0
    eligible = has_bad & has_good & ~missing
    qmin = np.full(R, np.inf)
    fin = lab & np.isfinite(q)
    np.minimum.at(qmin, f.r[fin], q[fin])
    tie = lab & eligible[f.r] & (np.abs(q - qmin[f.r]) <= TIE)
    hits = np.bincount(f.r, tie & (f.h == -1), R)
    ties = np.bincount(f.r, tie, R)
    share = np.divide(hits, ties, out=np.zeros(R), where=ties > 0)
    g_of = np.zeros(R, int)
    g_of[f.r] = f.g
    return (np.bincount(g_of[eligible], share[eligible], f.n_groups),
            np.bincount(g_of[eligible], minlength=f.n_groups).astype(float))


def figures(f: Frame, Q: np.ndarray, t: np.ndarray, *, constant: bool = False
            ) -> dict[str, dict[str, np.ndarray]]:
    """Per figure: per-group numerators and denominators (the bootstrap resamples groups), and
    the same for the uniform reference where the figure has one."""
    C, ng, nb = _auroc_parts(f, np.zeros_like(Q) if constant else Q)
    loser, winner = f.adv < 0, f.adv > 0
    bad, good = f.h == -1, f.h == 1
    at = np.abs(t)
    # n of a mass figure counts rollouts: each rollout's group, once
    first = np.r_[True, f.r[1:] != f.r[:-1]] if len(f.r) else np.zeros(0, bool)
    out: dict[str, dict[str, Any]] = {
        "auroc_quality": {"C": C, "ng": ng, "nb": nb},
        "bad_mass": {"num": _by_group(f, at * bad, loser), "den": _by_group(f, at, loser),
                     "unum": _by_group(f, f.n * bad, loser), "uden": _by_group(f, f.n, loser),
                     "rollouts": np.bincount(f.g[loser & first], minlength=f.n_groups)},
        "good_mass": {"num": _by_group(f, t * good, winner), "den": _by_group(f, t, winner),
                      "unum": _by_group(f, f.n * good, winner),
                      "uden": _by_group(f, f.n, winner),
                      "rollouts": np.bincount(f.g[winner & first], minlength=f.n_groups)},
    }
    num, den = _worst_parts(f, Q, constant)
    unum, uden = _worst_parts(f, Q, True)
    out["worst_step_hit"] = {"num": num, "den": den, "unum": unum, "uden": uden}
    return out


def _ratio(num: Any, den: Any) -> np.ndarray:
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    out: np.ndarray = np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)
    return out


def _value(name: str, parts: dict[str, np.ndarray], W: np.ndarray) -> np.ndarray:
    """The figure under group weights W (rows: draws; a row of ones is the data itself)."""
    if name == "auroc_quality":
        num = np.einsum("bg,gh,bh->b", W, parts["C"], W)
        return _ratio(num, (W @ parts["ng"]) * (W @ parts["nb"]))
    return _ratio(W @ parts["num"], W @ parts["den"])


def bootstrap_weights(n_groups: int, draws: int, seed: int) -> np.ndarray:
    """draws × groups: how often each group is drawn (resampling whole groups)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_groups, size=(draws, n_groups))
    W = np.zeros((draws, n_groups))
    np.add.at(W, (np.repeat(np.arange(draws), n_groups), idx.ravel()), 1)
    return W


def figure_rows(source: str, f: Frame, parts: dict[str, dict[str, np.ndarray]],
                W: np.ndarray) -> list[dict[str, Any]]:
    ones = np.ones((1, f.n_groups))
    rows = []
    for name in FIGURES:
        p = parts[name]
        value = float(_value(name, p, ones)[0])
        draws = _value(name, p, W)
        draws = draws[np.isfinite(draws)]
        lo, hi = (np.percentile(draws, [2.5, 97.5]) if draws.size else (np.nan, np.nan))
        if name == "auroc_quality":
            uniform, n = 0.5, int(p["ng"].sum() + p["nb"].sum())
            groups = int(((p["ng"] + p["nb"]) > 0).sum())
        else:
            uniform = float(_ratio(p["unum"].sum(), p["uden"].sum()))
            n = int(p["rollouts"].sum() if "rollouts" in p else p["den"].sum())
            groups = int(((p["rollouts"] if "rollouts" in p else p["den"]) > 0).sum())
        rows.append({"source": source, "figure": name, "value": _nan_none(value),
                     "ci_low": _nan_none(float(lo)), "ci_high": _nan_none(float(hi)),
                     "uniform": _nan_none(uniform),
                     "lift": _nan_none(value / uniform) if uniform else None,
                     "n": n, "n_groups": groups, "zero_advantage_rollouts": f.zero_adv})
    return rows


def _nan_none(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)


SCHEMA = polars_schema(StepLabelFigure)


def step_label_audit(steps: pl.DataFrame, rollouts: pl.DataFrame, labels: pl.DataFrame, *,
                     human: str = "human", run: RunCredit | None = None, seed: int = 0,
                     draws: int = 1000) -> pl.DataFrame:
    """One row per (credit source, figure): draco's run (with ``run``), uniform credit, each
    labeler's labels as verdicts (the human's own among them: the ceiling), and the seeded
    random-citation control; value, 95% bootstrap interval, the uniform value and the lift."""
    hum = labels.filter(pl.col("labeler") == human)
    adv = run.rewards if run is not None else outcome_advantage(rollouts)
    f = frame(steps, rollouts, hum, adv)
    W = bootstrap_weights(f.n_groups, draws, seed)
    rows: list[dict[str, Any]] = []
    if run is not None:
        rows += figure_rows("run", f, figures(f, *run_credit(f, run.step_credit)), W)
    rows += figure_rows("uniform", f, figures(f, np.ones(len(f.r)), f.n * f.adv,
                                              constant=True), W)
    for name in sorted(labels["labeler"].unique().to_list(), key=lambda x: (x != human, x)):
        p, q = label_counts(f, labels.filter(pl.col("labeler") == name))
        rows += figure_rows(f"labels:{name}", f, figures(f, *draco_credit(f, p, q)), W)
    if run is not None and run.verdicts is not None:
        base = run_verdicts(f, run.verdicts)
    else:
        # No run: verdicts that know nothing either, one per step, pass or fail at even odds
        # (verdicts drawn from the labels would carry each rollout's share of bad steps).
        coin = np.random.default_rng([seed, 1]).random(len(f.r)) < 0.5
        base = [(int(r), bool(c), 1) for r, c in zip(f.r, coin)]
    p, q = random_counts(f, base, seed)
    rows += figure_rows("random_citation", f, figures(f, *draco_credit(f, p, q)), W)
    return pl.DataFrame(rows, schema=SCHEMA)
