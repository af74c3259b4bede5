"""Self-judge agreement with a reference judge, and its trend over training steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import polars as pl

from draco_cli.audit.stats import quarters, step_tests
from draco_cli.errors import UsageError
from draco_cli.schemas import Agreement, AgreementTest, polars_schema

if TYPE_CHECKING:
    from polars._typing import PythonLiteral




KEYS = ["rollout_id", "criterion_id"]


def _one_judge(v: pl.DataFrame, source: str) -> pl.DataFrame:
    dup = v.select(pl.struct(KEYS).is_duplicated().any()).item()
    if dup:
        judges = sorted(v["judge"].unique().to_list()) if "judge" in v.columns else []
        raise UsageError(f"{source}: several verdicts per (rollout, criterion)"
                         + (f" (judges {', '.join(judges)}): pass one judge's file" if judges
                            else ""))
    return v


def agreement_rows(self_v: pl.DataFrame, ref_v: pl.DataFrame,
                   rollouts: pl.DataFrame | None) -> pl.DataFrame:
    """One row per (rollout, criterion) the reference judged (null reference verdicts are
    left out): the two verdicts, train_step, and the indicators."""
    ref = _one_judge(ref_v, "reference").filter(pl.col("verdict").is_not_null()).select(
        *KEYS, pl.col("verdict").alias("ref"))
    me = _one_judge(self_v, "self").select(*KEYS, pl.col("verdict").alias("self"))
    rows = ref.join(me, on=KEYS, how="left")
    if rollouts is not None and "train_step" in rollouts.columns:
        rows = rows.join(rollouts.select("rollout_id", "train_step"), on="rollout_id",
                         how="left")
    else:
        rows = rows.with_columns(pl.lit(None, pl.Int32).alias("train_step"))
    return rows.with_columns(
        (pl.col("self") == pl.col("ref")).fill_null(False).alias("agree"),
        ((pl.col("ref") == "fail") & (pl.col("self") == "pass")).fill_null(False).alias("fp"),
        ((pl.col("ref") == "pass") & (pl.col("self") == "fail")).fill_null(False).alias("ff"),
        pl.col("self").is_null().alias("unanswered"),
    )


def _number(value: PythonLiteral | None) -> float:
    """A polars aggregate (typed as any Python literal) that is a number here: the mean of a
    non-empty numeric or boolean column."""
    return float(cast(float, value))


def _scope_metrics(rows: pl.DataFrame, scope: str) -> dict[str, Any]:
    n = rows.height
    ref_fail = int((rows["ref"] == "fail").sum())
    ref_pass = int((rows["ref"] == "pass").sum())
    fpr = int(rows["fp"].sum()) / ref_fail if ref_fail else None
    ffr = int(rows["ff"].sum()) / ref_pass if ref_pass else None
    return {
        "scope": scope,
        "n_rows": n,
        "agreement": _number(rows["agree"].mean()) if n else None,
        "pass_all_baseline": ref_pass / n if n else None,
        "false_pass_rate": fpr,
        "false_fail_rate": ffr,
        "leniency_ratio": fpr / ffr if fpr is not None and ffr else None,
        "unanswered_rate": _number(rows["unanswered"].mean()) if n else None,
        "criteria_per_rollout": n / rows["rollout_id"].n_unique() if n else None,
        "reference_fail_share": ref_fail / n if n else None,
    }


# metric -> (indicator column, rows it is a rate over)
TESTED = {
    "agreement": ("agree", None),
    "false_pass_rate": ("fp", "fail"),
    "false_fail_rate": ("ff", "pass"),
}


TEST_SCHEMA = polars_schema(AgreementTest)


def self_judge_audit(self_v: pl.DataFrame, ref_v: pl.DataFrame,
                     rollouts: pl.DataFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(agreement table: one row per scope, tests table: metric, test, statistic, p_value,
    n_steps). The tests take each train step as one observation (SPEC §4): verdicts of one
    step share its rollouts, rubrics and judge state, so rows are not independent."""
    rows = agreement_rows(self_v, ref_v, rollouts)
    out = [_scope_metrics(rows, "overall")]
    steps = sorted(rows["train_step"].drop_nulls().unique().to_list())
    for s in steps:
        out.append(_scope_metrics(rows.filter(pl.col("train_step") == s), f"step:{s}"))
    tests = []
    if steps:
        first, last = quarters(steps)
        a = rows.filter(pl.col("train_step").is_in(first))
        b = rows.filter(pl.col("train_step").is_in(last))
        out.append(_scope_metrics(a, "first_quarter"))
        out.append(_scope_metrics(b, "last_quarter"))
        for metric, (ind, ref) in TESTED.items():
            per_step = []
            for st in steps:
                rr = rows.filter(pl.col("train_step") == st)
                if ref is not None:
                    rr = rr.filter(pl.col("ref") == ref)
                per_step.append((st, _number(rr[ind].mean()) if rr.height else None, rr.height))
            tests += step_tests(metric, per_step)
    agreement = pl.DataFrame(out, schema=polars_schema(Agreement))
    tests_df = pl.DataFrame(tests, schema=TEST_SCHEMA)
    return agreement, tests_df
