"""Spot checks (``draco run --spot-check N``): a seeded sample of a step's verdicts asked again
of a gold judge, whose answers never enter the reward. See docs/run.md, "Spot checks"."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from draco_cli.errors import InputError
from draco_cli.schemas import SpotCheck, polars_schema

if TYPE_CHECKING:
    from draco_cli.judge.core import ScoreResult
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.llm.stage import StageReport
    from draco_cli.llm.types import Sampling
    from draco_cli.choices import Drop
    from draco_cli.prompts.render import RenderOptions

GOLD_LABEL = "gold"
SPOT_SCHEMA = polars_schema(SpotCheck)


def sample_verdicts(verdicts: pl.DataFrame, rollouts: pl.DataFrame, n: int, seed: int,
                    train_step: int | None) -> pl.DataFrame:
    """``n`` of the training judge's answered verdicts (pass, fail or na), uniformly without
    replacement (all of them when fewer), in a fixed order first so the draw depends on the
    seed and the train step only, never on file order."""
    cols = [c for c in ("rollout_id", "criterion_id", "judge", "verdict", "retained")
            if c in verdicts.columns]
    cand = verdicts.select(cols).filter(pl.col("verdict").is_not_null()).join(
        rollouts.select("rollout_id", "group_id"), on="rollout_id", how="inner").sort(
        "rollout_id", "criterion_id", "judge")
    if "retained" not in cand.columns:
        cand = cand.with_columns(pl.lit(None, dtype=pl.Boolean).alias("retained"))
    rng = np.random.default_rng([seed, 0 if train_step is None else train_step + 1])
    take = np.sort(rng.choice(cand.height, size=min(n, cand.height), replace=False))
    return cand[take.tolist()] if cand.height else cand


def spot_table(sample: pl.DataFrame, gold: pl.DataFrame, gold_model: str, seed: int,
               train_step: int | None) -> pl.DataFrame:
    """The sampled verdicts beside the gold judge's (``gold``: aggregated verdicts)."""
    g = gold.select("rollout_id", "criterion_id", pl.col("verdict").alias("gold_verdict"),
                    pl.col("reason").alias("gold_reason"))
    out = sample.join(g, on=["rollout_id", "criterion_id"], how="left", maintain_order="left")
    return out.select(
        "rollout_id", "group_id", "criterion_id",
        pl.lit(train_step, pl.Int64).alias("train_step"), "judge",
        pl.col("verdict").alias("judge_verdict"), "gold_verdict",
        pl.when(pl.col("verdict") == "na").then(None).otherwise(pl.col("verdict") == "pass")
        .alias("judge_pass"),
        pl.when(pl.col("gold_verdict").is_in(["pass", "fail"]))
        .then(pl.col("gold_verdict") == "pass").otherwise(None).alias("gold_pass"),
        pl.when(pl.col("gold_verdict").is_null()).then(None)
        .otherwise(pl.col("verdict") == pl.col("gold_verdict")).alias("agree"),
        pl.col("retained").cast(pl.Boolean), pl.lit(gold_model).alias("gold_model"),
        pl.col("gold_reason").fill_null("no answer"),
        pl.lit(seed, pl.Int64).alias("seed")).cast(pl.Schema(SPOT_SCHEMA))


def spot_stage(sample: pl.DataFrame, rollouts: pl.DataFrame, steps: pl.DataFrame,
               rubrics: pl.DataFrame, *, gold_model: str, seed: int, train_step: int | None,
               sampling: Sampling | None = None, render: RenderOptions | None = None
               ) -> Generator[Any, Any, pl.DataFrame]:
    """The gold judge's calls for the sampled rollouts, as a stage (``llm.drive``), and the
    spot-check table."""
    from draco_cli.judge.core import score_stage

    ids = sample["rollout_id"].unique().implode()
    r = rollouts.filter(pl.col("rollout_id").is_in(ids))
    s = steps.filter(pl.col("rollout_id").is_in(ids))
    rb = rubrics.filter(pl.col("group_id").is_in(r["group_id"].unique().implode()))
    res: ScoreResult = yield from score_stage(r, s, rb, samples=1, aggregate="all",
                                              judge=GOLD_LABEL, sampling=sampling,
                                              render=render)
    return spot_table(sample, res.verdicts, gold_model, seed, train_step)


def spot_check_files(rollouts: Path, steps: Path, rubrics: Path, verdicts: Path, out: Path,
                     gold: LLMSettings, *, n: int, seed: int, train_step: int | None,
                     render: RenderOptions, max_tokens: int, call_log: Path,
                     drop: Drop = "all-pass") -> tuple[pl.DataFrame, StageReport]:
    """A run folder's spot checks → ``out`` (one Parquet file, published whole), the gold
    calls in ``call_log`` (a rerun pays for none of them again)."""
    from draco_cli.io import read_table
    from draco_cli.llm.calllog import CallLog
    from draco_cli.llm.drive import drive
    from draco_cli.llm.stage import StageReport, read_inputs
    from draco_cli.llm.types import Sampling
    from draco_cli.publish import publish_file
    from draco_cli.schemas import Rubric, SpotCheck, VerdictAggregated

    r, s = read_inputs(rollouts, steps)
    v = read_table(verdicts, VerdictAggregated)
    if v["judge"].n_unique() > 1:
        raise InputError("--spot-check: the verdicts hold several judges", file=str(verdicts),
                         field="judge")
    from draco_cli.credit import attach_groups, discriminative_filter

    v = discriminative_filter(attach_groups(v, r, str(verdicts)), drop)   # as the credit's
    sample = sample_verdicts(v, r, n, seed, train_step)
    report = StageReport(outputs=[out])
    with CallLog(call_log) as log:
        client = gold.client(log)
        table = drive(spot_stage(sample, r, s, read_table(rubrics, Rubric),
                                 gold_model=gold.model, seed=seed, train_step=train_step,
                                 sampling=Sampling(max_tokens=max_tokens,
                                                   thinking=gold.thinking),
                                 render=render), client, batch=False)
        report.phases.update(client.stats)
        report.budget_reached = client.budget_reached
    publish_file(table, out, SpotCheck, force=True)
    report.rows = table.height
    unanswered = table["gold_verdict"].null_count()
    agreed = table["agree"].drop_nulls().cast(pl.Float64)
    report.notes.append(
        f"{table.height} verdicts spot-checked by {gold.model} (seed {seed}); agreement "
        + (f"{float(agreed.sum()) / agreed.len():.1%} over {agreed.len()}"
           if agreed.len() else "n/a")
        + (f"; {unanswered} unanswered" if unanswered else ""))
    return table, report
