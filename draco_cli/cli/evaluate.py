from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

if TYPE_CHECKING:
    import polars as pl

from draco_cli.cli.options import IN, OUT, Force, folder_path
from draco_cli.cli.output import Format, Json, Report, emit, note, pick_format, warn

def _parse_ks(k: str) -> list[int]:
    try:
        ks = [int(x) for x in k.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{k!r} is not a comma-separated list of positive integers, "
                                 "e.g. 1,2,3", param_hint="--k") from None
    if not ks or min(ks) < 1:
        raise typer.BadParameter(f"{k!r}: give positive integers, e.g. 1,2,3", param_hint="--k")
    return ks


def _scope_document(metrics: pl.DataFrame, scope: str) -> dict[str, Any]:
    """The JSON form of one scope's figures, from the long metrics table."""
    doc: dict[str, Any] = {"pass_hat_k": {}, "pass_at_k": {}, "termination_shares": {}}
    for row in metrics.filter(metrics["scope"] == scope).iter_rows(named=True):
        m, k, v = row["metric"], row["k"], row["value"]
        if m in ("pass_hat_k", "pass_at_k", "sgc_hat_k"):
            doc.setdefault(m, {})[str(k)] = v
        elif m.startswith("termination:"):
            doc["termination_shares"][m.split(":", 1)[1]] = v
        elif m == "retention":
            doc["retention"] = {"k": k, "tgc": v, "sgc": doc.get("retention", {}).get("sgc")}
        elif m == "sgc_retention":
            doc.setdefault("retention", {"k": k, "tgc": None})["sgc"] = v
        else:
            doc[m] = v
        if m == "mean_turns":
            doc["n_rollouts"] = row["n"]
        if m == "tgc":
            doc["n_tasks"] = row["n"]
    return doc


def _label(metric: str, k: int | None) -> str:
    names = {"pass_hat_k": f"pass^{k}", "pass_at_k": f"pass@{k}", "sgc_hat_k": f"SGC^{k}",
             "tgc": "TGC (p^1)", "sgc": "SGC", "retention": f"retention p^{k}/p^1",
             "sgc_retention": f"SGC retention ^{k}/^1", "mean_turns": "mean turns"}
    if metric.startswith("termination:"):
        return "termination " + metric.split(":", 1)[1]
    return names.get(metric, metric)


def metrics_wide(metrics: pl.DataFrame) -> pl.DataFrame:
    """One row per figure, one column per scope (overall first): the screen form."""
    import polars as pl

    scopes = list(dict.fromkeys(metrics["scope"].to_list()))
    order = {"tgc": 0, "sgc": 1, "pass_hat_k": 2, "pass_at_k": 3, "sgc_hat_k": 4,
             "retention": 5, "sgc_retention": 6, "mean_turns": 7}
    keyed = metrics.with_columns(
        pl.struct("metric", "k").map_elements(lambda s: _label(s["metric"], s["k"]),
                                              return_dtype=pl.String).alias("figure"),
        pl.col("metric").replace_strict(order, default=8, return_dtype=pl.Int32).alias("_o"))
    rows = keyed.group_by("figure").agg(pl.col("_o").min(), pl.col("k").min()).sort(
        "_o", "k", "figure")
    wide = rows.select("figure")
    for scope in scopes:
        part = keyed.filter(pl.col("scope") == scope).select(
            "figure", pl.col("value").alias(scope))
        wide = wide.join(part, on="figure", how="left", maintain_order="left")
    return wide


def evaluate(
    rollouts: Annotated[list[Path] | None, typer.Option(
        "--rollouts", help="rollouts.parquet, a folder holding one, a draco run folder, or - "
        "(a table on stdin); repeat it (one per training step) to follow training: figures per "
        "train_step.", parser=IN)] = None,
    out: Annotated[Path | None, typer.Option(
        "-o", "--out", callback=folder_path,
        parser=OUT, help="Folder to write metrics.parquet into (optional).")] = None,
    k: Annotated[str, typer.Option("--k", help="Comma-separated k for pass^k and pass@k.")]
    = "1,2,3",
    by: Annotated[list[str] | None, typer.Option(
        "--by", help="Also report per value of this rollout column (repeatable): difficulty, "
        "train_step, ...")] = None,
    compare: Annotated[list[Path] | None, typer.Option(
        "--compare", help="Two runs (rollouts.parquet or folders): A then B. Prints both with "
        "B − A and a paired bootstrap 95% CI over tasks.", parser=IN)] = None,
    missing: Annotated[Literal["fail", "drop"], typer.Option(
        "--missing", help="Unbalanced trials: fail = every task has the data's number of "
        "distinct trials and a missing one counts as a failure (tau-bench's display_metrics, "
        "comparable with its leaderboard); drop = each task's own trials.")] = "fail",
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """TGC, SGC, pass^k, pass@k, retention, termination modes and turns: printed per scope
    (overall, each train step, each --by value), and written to OUT/metrics.parquet.

    Example: draco eval --rollouts runs/step-0 --rollouts runs/step-1 --k 1,2,3 --format json
    """
    import polars as pl

    from draco_cli.evaluate.core import missing_note
    from draco_cli.evaluate.stage import compare_runs, evaluate_runs

    shape = pick_format(fmt, as_json)
    ks = _parse_ks(k)
    if compare:
        if len(compare) != 2:
            raise typer.BadParameter("--compare takes exactly two runs: --compare A --compare B",
                                     param_hint="--compare")
        res = compare_runs(compare[0], compare[1], ks, missing=missing)
        emit(Report([(f"A = {compare[0]}   B = {compare[1]}", res)],
                     document=res.to_dicts()), shape)
        return
    by = list(by or [])
    result = evaluate_runs(rollouts or [], ks, by=by, missing=missing, out=out, force=force)
    if out is not None:
        note(f"wrote {out / 'metrics.parquet'}")
    warnings = list(result.warnings)
    for w in warnings:
        warn(w)
    s = result.summary
    note(missing_note(s))
    doc = {"tgc": s["tgc"], "sgc": s["sgc"],
           "pass_hat_k": {str(kk): v for kk, v in s["pass_hat_k"].items()},
           "pass_at_k": {str(kk): v for kk, v in s["pass_at_k"].items()},
           "retention": s["retention"], "mean_turns": s["mean_turns"],
           "termination_shares": s["termination_shares"], "n_tasks": s["n_tasks"],
           "n_rollouts": s["n_rollouts"], "missing": s["missing"],
           "by": {scope: _scope_document(result.metrics, scope)
                  for scope in dict.fromkeys(result.metrics["scope"].to_list())
                  if scope != "overall"},
           "warnings": warnings}
    shown = result.metrics
    if len(rollouts or []) == 1 and "train_step" not in by:
        # one training step: its column would repeat overall
        shown = shown.filter(~pl.col("scope").str.starts_with("train_step="))
    emit(Report([(f"{s['n_rollouts']} rollouts, {s['n_tasks']} tasks",
                  metrics_wide(shown))] if shape != "csv" else
                [("metrics", result.metrics)], document=doc), shape)
