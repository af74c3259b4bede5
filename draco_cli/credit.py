"""DRACO credit (SPEC §3.3–3.6): the discriminative filter, rewards, group advantages and step
credit, as whole-column polars operations (no per-rollout Python loops).

Every function takes and returns polars DataFrames; ``compute_credit`` chains them the way
``draco credit compute`` does. Token-level output lives in ``draco_cli.tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import polars as pl

from draco_cli.errors import InputError, UsageError

EPS = 1e-6
Drop = Literal["all-pass", "constant"]
Estimator = Literal["grpo", "rloo"]
StdMode = Literal["sample", "population", "none"]
CreditKind = Literal["step", "uniform"]
RewardSource = Literal["rubric", "outcome"]


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


# --- inputs -------------------------------------------------------------------------------


def narrow_judge(verdicts: pl.DataFrame, judge: str | None, source: str = "verdicts") -> pl.DataFrame:
    """Keep one judge's verdicts. Mixing judges in one computation is an error (SPEC §3.3)."""
    judges = sorted(verdicts["judge"].unique().to_list())
    if judge is not None:
        if judge not in judges:
            raise UsageError(f"--judge {judge!r}: {source} has judges {', '.join(judges) or 'none'}")
        return verdicts.filter(pl.col("judge") == judge)
    if len(judges) > 1:
        raise UsageError(
            f"{source} holds verdicts of several judges ({', '.join(judges)}); "
            "choose one with --judge LABEL"
        )
    return verdicts


def attach_groups(verdicts: pl.DataFrame, rollouts: pl.DataFrame, source: str) -> pl.DataFrame:
    """Add group_id to verdicts; a verdict for a rollout not in ``rollouts`` is an error."""
    joined = verdicts.with_row_index("__row").join(
        rollouts.select("rollout_id", "group_id"), on="rollout_id", how="left"
    )
    missing = joined.filter(pl.col("group_id").is_null())
    if missing.height:
        row = int(missing["__row"].min())
        rid = joined.filter(pl.col("__row") == row)["rollout_id"][0]
        raise InputError(f"verdict for unknown rollout {rid!r}", file=source, row=row,
                         field="rollout_id")
    return joined.sort("__row").drop("__row")


def check_steps(steps: pl.DataFrame, rollouts: pl.DataFrame, source: str) -> None:
    """Steps must belong to known rollouts and run 1..M without gaps."""
    indexed = steps.with_row_index("__row")
    orphan = indexed.join(rollouts.select("rollout_id"), on="rollout_id", how="anti")
    if orphan.height:
        row = int(orphan["__row"].min())
        raise InputError(f"step of unknown rollout {orphan['rollout_id'][0]!r}", file=source,
                         row=row, field="rollout_id")
    stats = steps.group_by("rollout_id").agg(
        pl.len().alias("m"), pl.col("step").max().alias("mx"), pl.col("step").min().alias("mn")
    )
    bad = stats.filter((pl.col("mx") != pl.col("m")) | (pl.col("mn") != 1))
    if bad.height:
        rid = bad["rollout_id"][0]
        row = int(indexed.filter(pl.col("rollout_id") == rid)["__row"].min())
        raise InputError(
            f"steps of rollout {rid!r} do not run 1..M without gaps", file=source, row=row,
            field="step",
        )


# --- §3.3 discriminative filter -----------------------------------------------------------


def discriminative_filter(verdicts: pl.DataFrame, drop: Drop = "all-pass") -> pl.DataFrame:
    """Add ``retained``: criterion c of group g is kept iff some member of g failed it.

    ``drop="constant"`` also drops criteria every answered member failed. Needs ``group_id``.
    """
    if drop not in ("all-pass", "constant"):
        raise UsageError(f"--drop {drop!r}: choose all-pass or constant")
    v = pl.col("verdict")
    per = verdicts.group_by("group_id", "criterion_id").agg(
        (v == "fail").any().alias("__any_fail"),
        ((v == "pass") | (v == "na")).any().alias("__any_other"),
    )
    keep = pl.col("__any_fail")
    if drop == "constant":
        keep = keep & pl.col("__any_other")
    per = per.select("group_id", "criterion_id", keep.alias("retained"))
    out = verdicts.drop("retained", strict=False).join(
        per, on=["group_id", "criterion_id"], how="left", maintain_order="left"
    )
    return out


# --- §3.4 reward, §3.5 group advantage -----------------------------------------------------


def rewards_table(
    rollouts: pl.DataFrame, verdicts: pl.DataFrame, reward: RewardSource = "rubric"
) -> pl.DataFrame:
    """Per rollout: n_pass / n_fail / n_na over retained criteria, reward, pass_rate_all."""
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
    """A_i per SPEC §3.5, aligned with ``rewards`` rows.

    grpo: (r − mean) / (std + ε) over the group's non-null rewards (std: sample = ddof 1,
    as verl; population = ddof 0; none = Dr. GRPO, no division). rloo: r − mean of the others.
    A null reward, a group with one scored member, or a group whose rewards are all equal → 0.
    """
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


def citation_counts(
    steps: pl.DataFrame, verdicts: pl.DataFrame
) -> tuple[pl.DataFrame, int]:
    """p_j, f_j per (rollout, step) from retained pass/fail verdicts, and the number of
    citations dropped as outside 1..M. A criterion citing a step twice counts once."""
    m = steps.group_by("rollout_id").agg(pl.len().cast(pl.Int32).alias("__m"))
    cites = (
        verdicts.filter(pl.col("retained") & pl.col("verdict").is_in(["pass", "fail"]))
        .select("rollout_id", "criterion_id", "verdict", pl.col("cited_steps").alias("step"))
        .explode("step")
        .drop_nulls("step")
        .join(m, on="rollout_id", how="left")
    )
    valid = (pl.col("step") >= 1) & (pl.col("step") <= pl.col("__m").fill_null(0))
    dropped = cites.select((~valid).sum()).item()
    counts = (
        cites.filter(valid)
        .unique(["rollout_id", "criterion_id", "step"])
        .group_by("rollout_id", "step")
        .agg(
            (pl.col("verdict") == "pass").sum().cast(pl.Int32).alias("p"),
            (pl.col("verdict") == "fail").sum().cast(pl.Int32).alias("f"),
        )
        .with_columns(pl.col("step").cast(pl.Int32))
    )
    return counts, int(dropped)


def step_credit_table(
    steps: pl.DataFrame,
    counts: pl.DataFrame,
    advantages: pl.DataFrame,
    credit: CreditKind = "step",
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Step credit per SPEC §3.6.

    ``advantages`` has rollout_id and advantage (A_i). Returns (step_credit, modes) where modes
    has rollout_id and credit_mode for every rollout of ``advantages``.
    """
    if credit not in ("step", "uniform"):
        raise UsageError(f"--credit {credit!r}: choose step or uniform")
    sc = (
        steps.select("rollout_id", "step", "n_tokens")
        .join(counts, on=["rollout_id", "step"], how="left")
        .with_columns(pl.col("p", "f").fill_null(0))
        .join(advantages.select("rollout_id", "advantage"), on="rollout_id", how="left")
        .rename({"advantage": "__A"})
        .with_columns(pl.col("__A").fill_null(0.0))
    )
    rid = "rollout_id"
    cited = (pl.col("p") + pl.col("f")) > 0
    q_cited = pl.when(cited).then(pl.col("p") / (pl.col("p") + pl.col("f")))
    sc = sc.with_columns(cited.alias("cited"), q_cited.alias("__q"))
    sc = sc.with_columns(
        pl.col("__q").fill_null(pl.col("__q").mean().over(rid)).alias("quality"),
        pl.col("cited").any().over(rid).alias("__any_cited"),
        pl.col("n_tokens").cast(pl.Float64).sum().over(rid).alias("__N"),
        pl.len().over(rid).alias("__M"),
    )
    A = pl.col("__A")
    w = pl.when(A >= 0).then(pl.col("quality")).otherwise(1.0 - pl.col("quality"))
    sc = sc.with_columns(w.alias("__w"))
    sumw = pl.col("__w").sum().over(rid)
    # Σw = 0 (e.g. a winner whose every cited step failed): equal shares, w_j = 1/M.
    weight = pl.when(sumw > 0).then(pl.col("__w")).otherwise(1.0 / pl.col("__M"))
    sc = sc.with_columns(weight.alias("weight"))
    sumw_eff = pl.col("weight").sum().over(rid)
    step_adv = A * pl.col("__N") * pl.col("weight") / (pl.col("n_tokens") * sumw_eff)
    if credit == "step":
        mode = pl.when(pl.col("__any_cited")).then(pl.lit("step")).otherwise(pl.lit("grpo_fallback"))
    else:
        mode = pl.lit("uniform")
    sc = sc.with_columns(mode.alias("__mode"))
    use_step = pl.col("__mode") == "step"
    sc = sc.with_columns(
        (pl.when(use_step).then(step_adv).otherwise(A) + 0.0).alias("advantage"),
        pl.when(pl.col("__any_cited")).then(pl.col("quality")).otherwise(None).alias("quality"),
        pl.when(use_step).then(pl.col("weight")).otherwise(None).alias("weight"),
    ).with_columns((pl.col("n_tokens") * pl.col("advantage")).alias("total"))
    step_table = sc.select(
        "rollout_id", "step", "n_tokens", "p", "f", "cited", "quality", "weight", "advantage",
        "total",
    )
    per_rollout = sc.group_by(rid).agg(pl.col("__mode").first().alias("credit_mode"))
    # Rollouts with no steps at all (no_action): nothing cited, so baseline GRPO.
    modes = advantages.select(rid).join(per_rollout, on=rid, how="left", maintain_order="left")
    modes = modes.with_columns(
        pl.col("credit_mode").fill_null("uniform" if credit == "uniform" else "grpo_fallback")
    )
    return step_table, modes


# --- the whole computation ----------------------------------------------------------------


@dataclass
class CreditResult:
    rewards: pl.DataFrame
    step_credit: pl.DataFrame
    stats: CreditStats


def compute_credit(
    rollouts: pl.DataFrame,
    steps: pl.DataFrame,
    verdicts: pl.DataFrame,
    *,
    credit: CreditKind = "step",
    estimator: Estimator = "grpo",
    std: StdMode = "sample",
    drop: Drop = "all-pass",
    reward: RewardSource = "rubric",
    judge: str | None = None,
    verdicts_source: str = "verdicts",
    steps_source: str = "steps",
) -> CreditResult:
    """Rewards and step credit for every rollout (SPEC §3.3–3.6).

    Applies the discriminative filter when ``verdicts`` has no ``retained`` column.
    """
    check_steps(steps, rollouts, steps_source)
    verdicts = narrow_judge(verdicts, judge, verdicts_source)
    verdicts = attach_groups(verdicts, rollouts, verdicts_source)
    unfiltered = "retained" not in verdicts.columns or (
        verdicts.height > 0 and verdicts["retained"].null_count() == verdicts.height
    )
    if unfiltered:
        verdicts = discriminative_filter(verdicts, drop)
    else:
        verdicts = verdicts.with_columns(pl.col("retained").fill_null(False))
    rw = rewards_table(rollouts, verdicts, reward)
    rw = rw.with_columns(group_advantage(rw, estimator, std))
    counts, dropped = citation_counts(steps, verdicts)
    step_table, modes = step_credit_table(steps, counts, rw.select("rollout_id", "advantage"),
                                          credit)
    rw = rw.join(modes, on="rollout_id", how="left", maintain_order="left")
    crit = verdicts.group_by("group_id", "criterion_id").agg(pl.col("retained").first())
    stats = CreditStats(
        groups=rollouts["group_id"].n_unique(),
        rollouts=rollouts.height,
        criteria_kept=int(crit["retained"].sum()),
        criteria_dropped=int(crit.height - crit["retained"].sum()),
        citations_dropped=dropped,
        credit_modes=dict(rw.group_by("credit_mode").len().sort("credit_mode").iter_rows()),
        advantage_min=rw["advantage"].min(),
        advantage_max=rw["advantage"].max(),
        mean_reward=rw["reward"].mean(),
        mean_pass_rate_all=rw["pass_rate_all"].mean(),
        null_rewards=rw["reward"].null_count(),
    )
    return CreditResult(rewards=rw, step_credit=step_table, stats=stats)
