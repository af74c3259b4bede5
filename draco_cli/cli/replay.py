from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import Force

app = typer.Typer(help="CREDO: replay planning, corrected credit, heads, rubric evolution.",
                  no_args_is_help=True)


def _read(path: Path):
    import polars as pl

    from draco_cli.io import read_arrow

    return pl.from_arrow(read_arrow(path))


def _write(df, path: Path, force: bool, metadata: dict | None = None) -> None:
    from draco_cli.io import atomic_path, check_writable

    check_writable(path, force)
    with atomic_path(path, force) as tmp:
        df.write_parquet(tmp)


@app.command("plan")
def plan_cmd(
    positions: Annotated[Path, typer.Option("--positions", help="One row per (rollout_id, step) "
                                            "with prediction, error, optional score_norm and "
                                            "cost.")],
    budget: Annotated[float, typer.Option("--budget", help="Replay budget in step-executions "
                                          "(the unit of cost).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Plan file (Parquet).")],
    p_min: Annotated[float, typer.Option("--p-min", help="Smallest inclusion probability.")]
    = 0.05,
    seed: Annotated[int, typer.Option(help="Seed of the Bernoulli selection (recorded).")] = 0,
    replays: Annotated[int, typer.Option("--replays", min=1, help="K replays per side (default "
                                         "cost 2·K·(T − t + 1)).")] = 2,
    heads: Annotated[Optional[Path], typer.Option(
        help="Fitted heads (JSON): take prediction and error from them, recording the version.")]
    = None,
    features: Annotated[Optional[Path], typer.Option(
        help="Features for --heads (a step_credit.parquet or any rollout_id, step, numeric "
        "columns table).")] = None,
    rewards: Annotated[Optional[Path], typer.Option(
        help="rewards.parquet, when --features is a step_credit table.")] = None,
    force: Force = False,
) -> None:
    """Square-root replay allocation under a budget, Bernoulli selection → PLAN.

    Example: draco replay plan --positions positions.parquet --budget 5000 --seed 7 -o plan.parquet
    """
    import polars as pl

    from draco_cli.credo import Heads, plan

    pos = _read(positions)
    version = None
    if heads is not None:
        if features is None:
            raise typer.BadParameter("--heads needs --features")
        h = Heads.from_json(heads.read_text(), str(heads))
        F = _features(features, rewards)
        joined = pos.select("rollout_id", pl.col("step").cast(pl.Int64),
                            *[c for c in ("score_norm", "cost") if c in pos.columns]).join(
            F, on=["rollout_id", "step"], how="left", maintain_order="left")
        c, e = h.predict(joined)
        pos = joined.with_columns(pl.Series("prediction", c), pl.Series("error", e))
        version = h.version
    result = plan(pos, budget, p_min=p_min, seed=seed, replays=replays, head_version=version)
    _write(result, out, force)
    err_console.print(
        f"{result.height} positions, {int(result['selected'].sum())} selected; expected cost "
        f"{result['expected_cost'][0]:.6g} of budget {budget:g}; λ = {result['lambda'][0]:.6g}"
        f"{' (slack: the rest unspent)' if result['lambda'][0] == 0 else ''} → {out}",
        highlight=False)


def _features(path: Path, rewards: Optional[Path]):
    from draco_cli.credo import draco_features

    F = _read(path)
    if {"p", "f", "quality", "cited", "n_tokens"} <= set(F.columns):
        return draco_features(F, _read(rewards) if rewards else None)
    return F


@app.command("correct")
def correct_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", help="The plan written before labels.")],
    labels: Annotated[Path, typer.Option("--labels", help="rollout_id, step, side "
                                         "(realized|resampled), sample, return.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder.")],
    beta: Annotated[float, typer.Option(help="Weight of the rollout's RLOO outcome advantage.")]
    = 0.0,
    rollouts: Annotated[Optional[Path], typer.Option(help="rollouts.parquet (for --beta).")]
    = None,
    steps: Annotated[Optional[Path], typer.Option(help="steps.parquet: also write token "
                                                  "advantages.")] = None,
    no_correction: Annotated[bool, typer.Option("--no-correction", help="Use the stored "
                                                "predictions alone (the ablation).")] = False,
    clip: Annotated[Optional[float], typer.Option(help="Clip corrected credit to ±CLIP (breaks "
                                                  "unbiasedness; recorded).")] = None,
    force: Force = False,
) -> None:
    """Corrected credit Ĉ_t = c_t + (S_t/p_t)(Δ_t − c_t) → OUT/credit.parquet (and
    OUT/token_advantages.parquet with --steps).

    Example: draco replay correct --plan plan.parquet --labels labels.parquet -o credo
    """
    import polars as pl

    from draco_cli.credo import correct

    from draco_cli.io import require_finite

    r = _read(rollouts) if rollouts else None
    plan_df, labels_df = _read(plan_path), _read(labels)
    for df, cols, src in ((plan_df, ("prediction", "p"), plan_path),
                          (labels_df, ("return",), labels), (r, ("outcome",), rollouts)):
        if df is not None:
            require_finite(df, cols, str(src))
    credit, info = correct(plan_df, labels_df, beta=beta, rollouts=r,
                           no_correction=no_correction, clip=clip)
    out.mkdir(parents=True, exist_ok=True)
    _write(credit.with_columns(pl.lit(json.dumps(info)).alias("settings")),
           out / "credit.parquet", force)
    if steps is not None:
        from draco_cli.credo_tokens import credo_token_advantages

        if r is None:
            raise typer.BadParameter("--steps needs --rollouts")
        ta = credo_token_advantages(r, _read(steps), credit, beta)
        _write(ta, out / "token_advantages.parquet", force)
    err_console.print(
        f"{info['positions']} positions, {info['selected']} corrected from replay"
        f"{'' if info['correction'] else ' (--no-correction: predictions only)'}; "
        f"{info['labels_ignored']} labels for unselected positions ignored → {out}",
        highlight=False)


@app.command("fit")
def fit_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", help="Plan with selections.")],
    labels: Annotated[Path, typer.Option("--labels", help="Replay labels.")],
    features: Annotated[Path, typer.Option("--features", help="step_credit.parquet (DRACO "
                                           "features) or rollout_id, step, numeric columns.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Heads file (JSON).")],
    rewards: Annotated[Optional[Path], typer.Option(help="rewards.parquet for the reward "
                                                    "feature.")] = None,
    rollouts: Annotated[Optional[Path], typer.Option(help="rollouts.parquet: held-out "
                                                     "calibration split by task.")] = None,
    ridge: Annotated[float, typer.Option(help="Ridge penalty of the credit head.")] = 1.0,
    force: Force = False,
) -> None:
    """Fit the credit head (inverse-inclusion-weighted ridge of Δ) and the error head
    (non-negative regression of (Δ − c_old)²); versioned.

    Example: draco replay fit --plan plan.parquet --labels labels.parquet --features credit/step_credit.parquet -o heads.json
    """
    import polars as pl

    from draco_cli.credo import _training_rows, calibration, fit_heads, task_split
    from draco_cli.io import check_writable, write_text_atomic

    check_writable(out, force)
    F = _features(features, rewards)
    P, L = _read(plan_path), _read(labels)
    if rollouts is not None:
        train, held = task_split(_read(rollouts))
        h = fit_heads(P.filter(pl.col("rollout_id").is_in(list(train))), L, F, ridge)
        te = _training_rows(P.filter(pl.col("rollout_id").is_in(list(held))), L, F) \
            if held else None
        cal = calibration(h, te) if te is not None and te.height else None
    else:
        h, cal = fit_heads(P, L, F, ridge), None
    write_text_atomic(out, h.to_json(), force=force)
    err_console.print(f"{h.version}: {h.rows} labelled positions, features "
                      f"{', '.join(h.features)} → {out}", highlight=False)
    if cal is not None:
        err_console.print("held-out calibration (weighted means per prediction bin):")
        err_console.print(cal)


@app.command("evolve")
def evolve_cmd(
    plan_path: Annotated[Path, typer.Option("--plan")],
    labels: Annotated[Path, typer.Option("--labels")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="For the split by task.")],
    baseline: Annotated[Path, typer.Option("--baseline", help="Features under the current "
                                           "rubric (step_credit.parquet or a features table).")],
    candidate: Annotated[list[Path], typer.Option("--candidate", help="Features under one "
                                                  "rubric edit (repeatable).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Scores (Parquet).")],
    ridge: float = 1.0,
    holdout: Annotated[float, typer.Option(help="Share of tasks held out.")] = 0.2,
    force: Force = False,
) -> None:
    """Score rubric edits (add / remove / merge criteria, each recomputed into features) by the
    held-out variance-weighted objective and by MSE; accept the best if it beats the baseline.

    Example: draco replay evolve --plan plan.parquet --labels labels.parquet --rollouts d/rollouts.parquet --baseline sc0.parquet --candidate sc_merge.parquet -o evolve.parquet
    """
    from draco_cli.credo import evolve

    cands = {"baseline": _features(baseline, None)}
    for p in candidate:
        cands[p.stem] = _features(p, None)
    scores = evolve(_read(plan_path), _read(labels), _read(rollouts), cands, ridge, holdout)
    _write(scores, out, force)
    err_console.print(scores)
    best = scores.filter(scores["accepted"])
    err_console.print(f"accepted: {best['candidate'][0]}" if best.height else
                      "no edit beats the current rubric", highlight=False)


@app.command("exact-check")
def exact_check_cmd(
    replays: Annotated[int, typer.Option("--replays", min=1, help="K replays per side.")] = 2,
    p_min: Annotated[float, typer.Option("--p-min")] = 0.05,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Enumerate a small two-decision model exactly and show the corrected estimator's
    expectation equals the analytic gradient (to 1e-9), with variance for uniform vs
    square-root allocation at equal expected cost.

    Example: draco replay exact-check --replays 2
    """
    from rich.table import Table

    from draco_cli.credo_exact import exact_check

    rows = exact_check(K=replays, p_min=p_min)
    t = Table(title="exact enumeration vs analytic gradient", title_justify="left", box=None)
    for c in ("estimator", "max |E - grad|", "variance", "expected cost"):
        t.add_column(c, justify="left" if c == "estimator" else "right")
    for r in rows:
        t.add_row(r["estimator"], f"{r['max_abs_error']:.2e}", f"{r['variance']:.6f}",
                  f"{r['expected_cost']:.3f}")
    err_console.print(t)
    if as_json:
        typer.echo(json.dumps(rows))
    bad = [r for r in rows if r["estimator"].startswith("corrected") and r["max_abs_error"] > 1e-9]
    if bad:
        err_console.print("[red]a corrected estimator is biased[/]")
        raise typer.Exit(1)
