"""DRACO credit (SPEC §3.3–3.6): the discriminative filter, rewards, group advantages and step
credit, as whole-column operations (no per-rollout Python loops).

``compute_credit`` chains them the way ``draco credit compute`` does, over the rollouts it is
given (all of them, or a block of whole groups). Inputs as arrays are in ``credit.inputs``,
token-level output in ``credit.tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.credit.inputs import (StepArrays, _check_verdict_keys, _codes, require_groups,
                                     index_steps, narrow_judge, rollout_chunks, sum_by_offsets,
                                     verdict_flags, verdict_rows)
from draco_cli.choices import CreditKind, Drop, Estimator, RewardSource, StdMode
from draco_cli.credit.dropout import apply_dropout, check_dropout
from draco_cli.errors import DracoError, InputError, UsageError

EPS = 1e-6


@dataclass
class CreditStats:
    """What a user should see after a credit run (the command prints it)."""

    groups: int = 0
    rollouts: int = 0
    criteria_kept: int = 0
    criteria_dropped: int = 0
    citations_dropped: int = 0
    credit_modes: dict[str, int] = field(default_factory=dict)
    advantage_min: float | None = None
    advantage_max: float | None = None
    mean_reward: float | None = None
    mean_pass_rate_all: float | None = None
    null_rewards: int = 0
    nonzero_advantages: int = 0   # rollouts with A_i != 0: the ones the trainer learns from
    criteria_dropout: int = 0     # retained criteria left out by --rubric-dropout


# --- §3.3 discriminative filter -----------------------------------------------------------


def discriminative_filter(verdicts: pl.DataFrame, drop: Drop = "all-pass") -> pl.DataFrame:
    """Add ``retained`` by the discriminative filter (docs/credit.md §1). Needs ``group_id``."""
    if drop not in ("all-pass", "constant"):
        raise UsageError(f"--drop {drop!r}: choose all-pass or constant")
    v = pl.col("verdict")
    # A window over (group, criterion), not a group_by joined back: no second table of
    # string keys (at 6M verdicts: 40% faster, half the memory).
    keep = (v == "fail").any()
    if drop == "constant":
        keep = keep & ((v == "pass") | (v == "na")).any()
    out = verdicts.drop("retained", strict=False).with_columns(
        keep.over("group_id", "criterion_id").alias("retained"))
    return out


# --- §3.4 reward, §3.5 group advantage -----------------------------------------------------


def rewards_table(
    rollouts: pl.DataFrame, verdicts: pl.DataFrame, reward: RewardSource = "rubric",
    flags: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> pl.DataFrame:
    """Per rollout: n_pass / n_fail / n_na over retained criteria, reward, pass_rate_all.
    ``flags`` (``verdict_flags``, for verdicts carrying ``__r``) stand for their verdict
    column."""
    if "__r" in verdicts.columns:
        return _rewards_by_index(rollouts, verdicts, reward, flags)
    v = pl.col("verdict")
    counts = verdicts.group_by("rollout_id").agg(
        ((v == "pass") & pl.col("retained")).sum().cast(pl.Int32).alias("n_pass"),
        ((v == "fail") & pl.col("retained")).sum().cast(pl.Int32).alias("n_fail"),
        ((v == "na") & pl.col("retained")).sum().cast(pl.Int32).alias("n_na"),
        (v == "pass").sum().alias("__pass_all"),
        (v == "fail").sum().alias("__fail_all"),
    )
    out = rollouts.select("rollout_id", "group_id", "outcome").join(
        counts, on="rollout_id", how="left", maintain_order="left"
    ).with_columns(pl.col("n_pass", "n_fail", "n_na", "__pass_all", "__fail_all").fill_null(0))
    return _reward_columns(out, reward)


def _rewards_by_index(rollouts: pl.DataFrame, verdicts: pl.DataFrame, reward: RewardSource,
                      flags: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                      ) -> pl.DataFrame:
    """rewards_table's counts as bincounts over ``__r`` (the rollout's row): no string keys."""
    R = rollouts.height
    r = verdicts["__r"].to_numpy().astype(np.int64)
    is_pass, is_fail, is_na = flags if flags is not None else verdict_flags(verdicts["verdict"])
    kept = verdicts["retained"].fill_null(False).to_numpy()

    def count(flag: np.ndarray) -> np.ndarray:
        return np.bincount(r[flag], minlength=R)

    out = rollouts.select("rollout_id", "group_id", "outcome").with_columns(
        pl.Series("n_pass", count(is_pass & kept), dtype=pl.Int32),
        pl.Series("n_fail", count(is_fail & kept), dtype=pl.Int32),
        pl.Series("n_na", count(is_na & kept), dtype=pl.Int32),
        pl.Series("__pass_all", count(is_pass), dtype=pl.UInt32),
        pl.Series("__fail_all", count(is_fail), dtype=pl.UInt32),
    )
    return _reward_columns(out, reward)


def _reward_columns(out: pl.DataFrame, reward: RewardSource) -> pl.DataFrame:
    decided = pl.col("n_pass") + pl.col("n_fail")
    decided_all = pl.col("__pass_all") + pl.col("__fail_all")
    rubric_reward = pl.when(decided > 0).then(pl.col("n_pass") / decided).otherwise(None)
    out = out.with_columns(
        (rubric_reward if reward == "rubric" else pl.col("outcome").cast(pl.Float64)).alias("reward"),
        pl.when(decided_all > 0).then(pl.col("__pass_all") / decided_all).otherwise(None)
        .alias("pass_rate_all"),
    )
    return out.drop("__pass_all", "__fail_all", "outcome")


def group_advantage(
    rewards: pl.DataFrame, estimator: Estimator = "grpo", std: StdMode = "sample"
) -> pl.Series:
    """A_i per SPEC §3.5 (docs/credit.md §3), aligned with ``rewards`` rows."""
    r = pl.col("reward")
    g = "group_id"
    count = r.count().over(g)
    flat = (r.max().over(g) - r.min().over(g)) == 0
    if estimator == "rloo":
        raw = r - (r.sum().over(g) - r) / (count - 1)
    elif estimator == "grpo":
        centred = r - r.mean().over(g)
        if std == "none":
            raw = centred
        elif std in ("sample", "population"):
            raw = centred / (r.std(ddof=1 if std == "sample" else 0).over(g) + EPS)
        else:
            raise UsageError(f"--std {std!r}: choose sample, population or none")
    else:
        raise UsageError(f"--estimator {estimator!r}: choose grpo or rloo")
    adv = pl.when(r.is_null() | (count <= 1) | flat).then(0.0).otherwise(raw)
    return rewards.select((adv + 0.0).alias("advantage"))["advantage"]


# --- §3.6 step credit ---------------------------------------------------------------------


def citation_arrays(sa: StepArrays, verdicts: pl.DataFrame,
                    flags: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                    ) -> tuple[np.ndarray, np.ndarray, int]:
    """p_j, f_j for every step of ``sa`` from retained pass/fail verdicts (which carry ``__r``,
    the rollout index), and the number of citations dropped as outside 1..M. A criterion citing
    a step twice counts once. ``flags`` (``verdict_flags``) stand for the frame's verdict
    column when given."""
    # The citations of retained pass/fail verdicts are picked from all citations by their
    # verdict's flag (no filtered copy of the verdicts' list column).
    total = sa.r.size
    is_pass, is_fail, _ = flags if flags is not None else verdict_flags(verdicts["verdict"])
    counted = verdicts["retained"].fill_null(False).to_numpy() & (is_pass | is_fail)
    cites = verdicts["cited_steps"].to_arrow()
    if not counted.any():
        return np.zeros(total, np.int32), np.zeros(total, np.int32), 0
    # Step numbers and rollout rows stay in their narrow integer types (int32, uint32) until
    # the step's row is computed in int64: the same values in half the fresh memory.
    step = pc.list_flatten(cites).to_numpy(zero_copy_only=False)
    if step.dtype.kind not in "iu":  # null items come as floats: as before
        step = step.astype(np.int64)
    parent = pc.list_parent_indices(cites).to_numpy().astype(np.int64, copy=False)
    pick = counted[parent]
    if not pick.all():
        parent, step = parent[pick], step[pick]
    del pick
    vr = verdicts["__r"].to_numpy()[parent]  # each citation's rollout row
    valid = (step >= 1) & (step <= sa.M[vr])
    dropped = int(valid.size - np.count_nonzero(valid))
    if dropped:
        parent, step, vr = parent[valid], step[valid], vr[valid]
    del valid
    # The cited step's row among all steps; one count per (verdict, step): sort the combined
    # key and keep the first of each run. parent is non-decreasing, so the keys are sorted but
    # for each verdict's few citations (a stable, timsort pass over such data is close to
    # linear, and much faster than numpy's hash-based unique), and each position keeps its
    # parent: no key needs decoding but the step row.
    gidx = sa.offsets[vr] + step - 1
    del vr, step
    key = parent * max(total, 1) + gidx
    key.sort(kind="stable")
    first = np.ones(key.size, dtype=bool)
    np.not_equal(key[1:], key[:-1], out=first[1:])
    gidx = key[first] - parent[first] * max(total, 1)
    cite_pass = is_pass[parent[first]]
    del key, parent, first
    p = np.bincount(gidx[cite_pass], minlength=total).astype(np.int32)
    f = np.bincount(gidx[~cite_pass], minlength=total).astype(np.int32)
    return p, f, dropped


def step_credit_arrays(sa: StepArrays, p: np.ndarray, f: np.ndarray, adv_r: np.ndarray,
                       credit: CreditKind = "step") -> dict[str, Any]:
    """SPEC §3.6 over whole columns, block by block. ``adv_r`` is A_i per rollout. Returns
    numpy columns per step, and ``mode_r``: credit_mode per rollout (a polars Series)."""
    if credit not in ("step", "uniform"):
        raise UsageError(f"--credit {credit!r}: choose step or uniform")
    R = sa.offsets.size - 1
    total = sa.r.size
    cited = (p + f) > 0
    quality = np.empty(total)
    weight = np.empty(total)
    adv = np.empty(total)
    any_cited_r = np.zeros(R, dtype=bool)
    for r0, r1, s0, s1 in rollout_chunks(sa.offsets):
        rl = sa.r[s0:s1] - r0
        Rl = r1 - r0
        Ml = sa.M[r0:r1]

        def per_step(values: np.ndarray, counts: np.ndarray = Ml) -> np.ndarray:
            # each rollout's value on each of its steps: the same values as indexing by
            # ``rl`` (steps are sorted by rollout), at a fraction of a gather's cost
            return np.repeat(values, counts)

        c = cited[s0:s1]
        pp, ff = p[s0:s1], f[s0:s1]
        n = sa.n[s0:s1].astype(np.float64)
        local = sa.offsets[r0:r1 + 1] - s0
        with np.errstate(invalid="ignore", divide="ignore"):
            # an uncited step has p = f = 0: 0 / 1 is the +0.0 it takes (no select needed)
            q = pp / np.maximum(pp + ff, 1)
            # Sums of integers (cited flags, token counts) are exact in any order: integer
            # sums, as floats, equal the float bincounts bit for bit. The sums of q and w
            # below keep their bincounts (their order of addition is part of the result).
            n_cited = sum_by_offsets(c, local).astype(np.float64)
            qbar = np.bincount(rl, weights=q, minlength=Rl) / n_cited
            qual = np.where(c, q, per_step(qbar))       # an uncited step takes the mean Q̄
            A = per_step(adv_r[r0:r1])
            w = np.where(A >= 0, qual, 1.0 - qual)
            # w is NaN exactly on the steps of rollouts without a cited step (Q̄ = 0 / 0); their
            # sum is 0, as over NaN set to 0, and the other rollouts' sums are unchanged
            sumw_r = np.bincount(rl, weights=w, minlength=Rl)
            sumw_r[n_cited == 0] = 0.0
            sumw = per_step(sumw_r)
            equal = sumw == 0  # e.g. a winner whose every cited step failed: equal shares
            wt = np.where(equal, per_step(1.0 / Ml), w)
            N = per_step(sum_by_offsets(sa.n[s0:s1], local).astype(np.float64))
            # A · N · w / (n · Σw), the same operations in the same order, in place
            step_adv = A * N
            step_adv *= wt
            step_adv /= np.multiply(n, np.where(equal, 1.0, sumw), out=n)
        cited_r = n_cited > 0
        any_cited_r[r0:r1] = cited_r
        cited_s = per_step(cited_r)
        use_step = cited_s if credit == "step" else np.zeros(rl.size, dtype=bool)
        # written straight into the outputs (no block-sized temporaries)
        quality[s0:s1] = np.nan
        np.copyto(quality[s0:s1], qual, where=cited_s)
        weight[s0:s1] = np.nan
        np.copyto(weight[s0:s1], wt, where=use_step)
        out = adv[s0:s1]
        np.copyto(out, A)
        np.copyto(out, step_adv, where=use_step)
        out += 0.0  # turns -0.0 into 0.0
    # credit_mode per rollout made by polars from the flags (numpy strings would be
    # converted one by one)
    mode = (pl.when(pl.lit(pl.Series(any_cited_r))).then(pl.lit("step"))
            .otherwise(pl.lit("grpo_fallback")) if credit == "step"
            else pl.repeat(pl.lit("uniform"), R))
    mode_r = pl.select(mode.cast(pl.String).alias("credit_mode")).to_series()
    return {"p": p, "f": f, "cited": cited, "quality": quality, "weight": weight,
            "advantage": adv, "mode_r": mode_r}


def _nan_as_null(name: str, values: np.ndarray) -> pl.Series:
    """A float column with NaN as null, sharing ``values``' buffer (a validity mask only)."""
    return pl.Series(name, pa.array(values, mask=np.isnan(values)))


def step_credit_frame(sa: StepArrays, arrays: dict[str, np.ndarray]) -> pl.DataFrame:
    return sa.order().with_columns(
        pl.Series("n_tokens", sa.n),
        pl.Series("p", arrays["p"]),
        pl.Series("f", arrays["f"]),
        pl.Series("cited", arrays["cited"]),
        _nan_as_null("quality", arrays["quality"]),
        _nan_as_null("weight", arrays["weight"]),
        pl.Series("advantage", arrays["advantage"]),
        pl.Series("total", sa.n * arrays["advantage"]),  # n_j · a_j
        pl.Series("token_start", pa.array(sa.token_start, mask=sa.token_start < 0)),
    )


# --- the whole computation ----------------------------------------------------------------


@dataclass
class CreditResult:
    rewards: pl.DataFrame
    step_credit: pl.DataFrame
    stats: CreditStats
    steps: StepArrays
    dropout: pl.DataFrame | None = None   # the criteria --rubric-dropout left out


def compute_credit(
    rollouts: pl.DataFrame, steps: pl.DataFrame | StepArrays, verdicts: pl.DataFrame, *,
    credit: CreditKind = "step", estimator: Estimator = "grpo", std: StdMode = "sample",
    drop: Drop = "all-pass", reward: RewardSource = "rubric", judge: str | None = None,
    verdicts_source: str = "verdicts", steps_source: str = "steps",
    check_verdict_keys: bool = False,
    rubric_dropout: float = 0.0, dropout_seed: int = 0,
) -> CreditResult:
    """Rewards and step credit for every rollout (SPEC §3.3–3.6).

    Applies the discriminative filter when ``verdicts`` has no ``retained`` column. ``steps``
    may be given as ``index_steps`` of them (a caller can then free the steps frame first).
    ``check_verdict_keys`` checks the verdicts' keys are unique (for callers that read them
    without that check: on integer codes it costs a fraction of the string check).
    ``rubric_dropout`` > 0 leaves a seeded share of each group's retained criteria out
    (``credit.dropout``; the result's ``dropout`` lists them).
    """
    check_dropout(rubric_dropout)   # before any work (apply_dropout comes last)
    require_groups(rollouts)
    sa = steps if isinstance(steps, StepArrays) else index_steps(steps, rollouts, steps_source)
    if check_verdict_keys and verdicts.height and not bool(
            (verdicts["judge"] == verdicts["judge"][0]).all()):
        _check_verdict_keys(verdicts, None, verdicts_source)  # before narrowing, as at read
        check_verdict_keys = False
    verdicts = narrow_judge(verdicts, judge, verdicts_source)
    rows = verdict_rows(verdicts, rollouts, verdicts_source) if verdicts.height \
        else np.zeros(0, dtype=np.int64)
    if check_verdict_keys:
        _check_verdict_keys(verdicts, rows, verdicts_source, _codes(verdicts["criterion_id"]))
    verdicts = verdicts.drop("group_id", "__r", strict=False).with_columns(
        pl.Series("__r", rows, dtype=pl.UInt32))
    flags = verdict_flags(verdicts["verdict"])
    unfiltered = "retained" not in verdicts.columns or (
        verdicts.height > 0 and verdicts["retained"].null_count() == verdicts.height
    )
    groups = rollouts["group_id"].gather(verdicts["__r"])
    if unfiltered:
        verdicts = discriminative_filter(verdicts.with_columns(groups), drop).drop("group_id")
    else:
        verdicts = verdicts.with_columns(pl.col("retained").fill_null(False))
    crit = verdicts.select(groups, "criterion_id", "retained").group_by(
        "group_id", "criterion_id").agg(pl.col("retained").first())
    criteria_kept, criteria = int(crit["retained"].sum()), crit.height
    del crit, groups
    verdicts, dropout = apply_dropout(verdicts, rollouts, rubric_dropout, dropout_seed)
    # Only the columns still needed stay referenced (the ids and judge labels are freed when
    # the caller holds no other reference); the verdicts go once citations are counted.
    verdicts = verdicts.select(c for c in ("__r", "verdict", "cited_steps", "retained")
                               if c in verdicts.columns)
    rw = rewards_table(rollouts, verdicts, reward, flags)
    rw = rw.with_columns(group_advantage(rw, estimator, std))
    p, f, dropped = citation_arrays(sa, verdicts, flags)
    del verdicts, flags
    arrays = step_credit_arrays(sa, p, f, rw["advantage"].to_numpy().astype(np.float64), credit)
    rw = rw.with_columns(arrays["mode_r"])
    # Inputs are checked finite at read; this guards the arithmetic itself, because a trainer
    # given one NaN advantage gets NaN gradients.
    if not (np.isfinite(arrays["advantage"]).all() and rw["advantage"].is_finite().all()):
        top = rw["reward"].abs().max()
        if isinstance(top, float) and top > 1e150:   # finite, but too large to standardize
            raise InputError(f"rewards up to {top:g} overflow the group's standardization: "
                             "rescale them", field="outcome" if reward == "outcome" else
                             "reward", file="rollouts" if reward == "outcome" else None)
        raise DracoError("internal error: credit produced a non-finite advantage; nothing "
                         "was written (please report this with your inputs)")
    step_table = step_credit_frame(sa, arrays)
    stats = credit_stats(rw, rollouts["group_id"].n_unique(), criteria_kept,
                         criteria - criteria_kept, dropped,
                         0 if dropout is None else dropout.height)
    return CreditResult(rewards=rw, step_credit=step_table, stats=stats, steps=sa,
                        dropout=dropout)


def credit_stats(rw: pl.DataFrame, groups: int, criteria_kept: int, criteria_dropped: int,
                 citations_dropped: int, criteria_dropout: int = 0) -> CreditStats:
    """The stats of the rewards ``rw`` (its ``reward``, ``pass_rate_all``, ``advantage`` and
    ``credit_mode``: all of them, or the blocks' rows in order, since a mean of means would
    round differently) and of the counts given."""
    return CreditStats(
        groups=groups,
        rollouts=rw.height,
        criteria_kept=criteria_kept,
        criteria_dropped=criteria_dropped,
        citations_dropped=citations_dropped,
        credit_modes=dict(rw.group_by("credit_mode").len().sort("credit_mode").iter_rows()),
        # Float64 columns: their min, max and mean are floats (None when empty or all null)
        advantage_min=cast("float | None", rw["advantage"].min()),
        advantage_max=cast("float | None", rw["advantage"].max()),
        mean_reward=cast("float | None", rw["reward"].mean()),
        mean_pass_rate_all=cast("float | None", rw["pass_rate_all"].mean()),
        nonzero_advantages=int((rw["advantage"].fill_null(0.0) != 0).sum()),
        null_rewards=rw["reward"].null_count(),
        criteria_dropout=criteria_dropout,
    )
