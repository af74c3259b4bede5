from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import Force

EVAL_COLUMNS = ["rollout_id", "group_id", "task_id", "train_step", "trial", "scenario_id",
                "difficulty", "outcome", "termination", "n_turns"]


def _rollouts(path: Path):
    """A rollouts table, a folder holding rollouts.parquet, or a draco run folder (its
    manifest names the rollouts it ran on, and its train step)."""
    import polars as pl

    from draco_cli.io import read_table
    from draco_cli.schemas import Rollout

    from draco_cli.runfolder import RunFolder

    step = None
    if path.is_dir():
        if (path / "rollouts.parquet").exists() or not RunFolder.is_run_folder(path):
            path = path / "rollouts.parquet"
        else:
            folder = RunFolder.open(path)
            step = folder.train_step
            path = folder.rollouts
    r = read_table(path, Rollout, columns=EVAL_COLUMNS)
    if step is not None:
        # the run folder's training step labels its rollouts (a run made with --train-step N)
        r = r.with_columns(pl.lit(step, dtype=pl.Int32).alias("train_step"))
    return r


def evaluate(
    rollouts: Annotated[Optional[list[Path]], typer.Option(
        "--rollouts", help="rollouts.parquet, a folder holding one, or a draco run folder; "
        "repeat it (one per training step) to follow training: figures per train_step.")]
    = None,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Output folder.")] = None,
    k: Annotated[str, typer.Option("--k", help="Comma-separated k for pass^k and pass@k.")]
    = "1,2,3",
    by: Annotated[Optional[list[str]], typer.Option(
        "--by", help="Also report per value of this rollout column (repeatable): difficulty, "
        "train_step, ...")] = None,
    compare: Annotated[Optional[list[Path]], typer.Option(
        "--compare", help="Two runs (rollouts.parquet or folders): A then B. Prints both with "
        "B − A and a paired bootstrap 95% CI over tasks.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON on stdout.")]
    = False,
    missing: Annotated[str, typer.Option(
        "--missing", help="Unbalanced trials: fail = every task has the data's number of "
        "distinct trials and a missing one counts as a failure (tau-bench's display_metrics, "
        "comparable with its leaderboard); drop = each task's own trials.")] = "fail",
    force: Force = False,
) -> None:
    """TGC, SGC, pass^k, pass@k, retention, termination modes and turns → OUT/metrics.parquet.

    Example: draco eval --rollouts runs/tau/rollouts.parquet --k 1,2,3,4 -o runs/tau/eval --json
    """
    from rich.table import Table

    from draco_cli.evaluate import compare as compare_runs
    from draco_cli.evaluate import evaluate as run_eval
    from draco_cli.evaluate import missing_note
    from draco_cli.io import atomic_path, check_writable

    ks = [int(x) for x in k.split(",") if x.strip()]
    if compare:
        if len(compare) != 2:
            raise typer.BadParameter("--compare takes exactly two runs: --compare A --compare B")
        res = compare_runs(_rollouts(compare[0]), _rollouts(compare[1]), ks, missing=missing)
        t = Table(title=f"A = {compare[0]}   B = {compare[1]}", title_justify="left", box=None)
        for c in res.columns:
            t.add_column(c, justify="right")
        for row in res.iter_rows():
            t.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row])
        err_console.print(t)
        if as_json:
            typer.echo(json.dumps(res.to_dicts()))
        return
    if not rollouts:
        raise typer.BadParameter("give --rollouts (or --compare A --compare B)")
    import polars as pl

    frames = [_rollouts(p) for p in rollouts]
    by = list(by or [])
    if len(frames) > 1:
        keyed = [set(zip(f["rollout_id"], f["train_step"])) for f in frames]
        if len(set().union(*keyed)) < sum(len(k) for k in keyed):
            raise typer.BadParameter("the runs share rollout ids but not train steps: pass run "
                                     "folders made with --train-step")
        if "train_step" not in by:
            by.append("train_step")
    result = run_eval(pl.concat(frames, how="vertical_relaxed"), ks, by, missing)
    if out is not None:
        target = out / "metrics.parquet"
        check_writable(target, force)
        with atomic_path(target, force) as tmp:
            result.metrics.write_parquet(tmp)
    s = result.summary
    t = Table(title=f"{s['n_rollouts']} rollouts, {s['n_tasks']} tasks", title_justify="left",
              box=None)
    t.add_column("metric")
    t.add_column("value", justify="right")
    fmt = lambda v: "—" if v is None else f"{v:.4f}"  # noqa: E731
    t.add_row("TGC (p^1)", fmt(s["tgc"]))
    t.add_row("SGC", fmt(s["sgc"]))
    for kk in ks:
        t.add_row(f"pass^{kk}", fmt(s["pass_hat_k"].get(kk)))
        t.add_row(f"pass@{kk}", fmt(s["pass_at_k"].get(kk)))
    t.add_row(f"retention p^{s['retention']['k']}/p^1", fmt(s["retention"]["tgc"]))
    t.add_row("mean turns", fmt(s["mean_turns"]))
    for mode, share in s["termination_shares"].items():
        t.add_row(f"termination {mode}", fmt(share))
    err_console.print(t)
    err_console.print(missing_note(s), highlight=False)
    for w in result.warnings:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
    if as_json:
        typer.echo(json.dumps({
            "tgc": s["tgc"], "sgc": s["sgc"],
            "pass_hat_k": {str(kk): v for kk, v in s["pass_hat_k"].items()},
            "pass_at_k": {str(kk): v for kk, v in s["pass_at_k"].items()},
            "retention": s["retention"], "mean_turns": s["mean_turns"],
            "termination_shares": s["termination_shares"], "n_tasks": s["n_tasks"],
            "n_rollouts": s["n_rollouts"], "missing": s["missing"]}))
