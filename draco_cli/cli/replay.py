from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import IN, OUT, Force, OutDir, llm_options

if TYPE_CHECKING:
    import polars as pl

    from draco_cli.llm.settings import LLMSettings

app = typer.Typer(help="CREDO: replay planning, corrected credit, heads, rubric evolution.",
                  no_args_is_help=True)


@app.command("plan")
def plan_cmd(
    positions: Annotated[Path, typer.Option("--positions", help="One row per (rollout_id, step) "
                                            "with prediction, error, optional score_norm and "
                                            "cost.", parser=IN)],
    budget: Annotated[float, typer.Option("--budget", help="Replay budget in step-executions "
                                          "(the unit of cost).")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT, help="Plan file (Parquet).")],
    p_min: Annotated[float, typer.Option("--p-min", help="Smallest inclusion probability.")]
    = 0.05,
    seed: Annotated[int, typer.Option(help="Seed of the Bernoulli selection (recorded).")] = 0,
    replays: Annotated[int, typer.Option("--replays", min=1, help="K replays per side (default "
                                         "cost K·(T − t + 1) + K·(T − t) actions).")] = 2,
    steps: Annotated[Path | None, typer.Option(
        "--steps", help="steps.parquet: each rollout's number of steps T for the default cost "
        "(needed unless the positions carry cost or n_steps).", parser=IN)] = None,
    allocation: Annotated[str, typer.Option(
        "--allocation", help="sqrt = square-root allocation (Eq. 10); uniform = one p for "
        "every position at the same expected cost (the paper's uniform-replay arm).")] = "sqrt",
    heads: Annotated[Path | None, typer.Option(parser=IN,
        help="Fitted heads (JSON): take prediction and error from them, recording the version.")]
    = None,
    features: Annotated[Path | None, typer.Option(
        help="Features for --heads (a step_credit.parquet or any rollout_id, step, numeric "
        "columns table).", parser=IN)] = None,
    rewards: Annotated[Path | None, typer.Option(
        parser=IN, help="rewards.parquet, when --features is a step_credit table.")] = None,
    force: Force = False,
) -> None:
    """Square-root replay allocation under a budget, Bernoulli selection → PLAN.

    Example: draco replay plan --positions positions.parquet --steps steps.parquet --budget 5000 --seed 7 -o plan.parquet
    """
    from draco_cli.credo.stage import plan_replay

    result = plan_replay(positions, budget, out, p_min=p_min, seed=seed, replays=replays,
                         steps=steps, allocation=allocation, heads=heads, features=features,
                         rewards=rewards, force=force)
    err_console.print(
        f"{result.height} positions, {int(result['selected'].sum())} selected ({allocation}); "
        f"expected cost "
        f"{result['expected_cost'][0]:.6g} of budget {budget:g}; λ = {result['lambda'][0]:.6g}"
        f"{' (slack: the rest unspent)' if result['expected_cost'][0] < budget * (1 - 1e-9) else ''}"
        f" → {out}",
        highlight=False)


@app.command("run")
def run_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", parser=IN,
                                            help="The plan (replay plan's output).")],
    env: Annotated[str, typer.Option(
        "--env", help="The environment: a command speaking the replay protocol as JSON lines on "
        "stdin/stdout (one copy per worker), or an http:// URL taking one POST per replay.")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT,
                                      help="Output folder: labels.parquet, "
                                      "replay_cost.parquet, replay_log.jsonl (the resume log).")],
    workers: Annotated[int, typer.Option("--workers", min=1, help="Replays run at once.")] = 2,
    replays: Annotated[int | None, typer.Option(
        "--replays", min=1, help="K per side (default: the plan's).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for one replay's "
                                           "answer; a silent subprocess is stopped and "
                                           "restarted, the replay counted as failed.")]
    = 600.0,
    force: Force = False,
) -> None:
    """Run the plan's replays in an external environment → OUT/labels.parquet. Resumable: a
    rerun skips every replay its log holds (--force rewrites the outputs and keeps the log of
    the same plan; a log of another plan is replaced only with --force).

    Example: draco replay run --plan plan.parquet --env "python examples/chain_env.py serve" -o replays
    """
    from draco_cli.cli.llmrun import progress_bar
    from draco_cli.credo.stage import run_replay
    from draco_cli.llm.types import Progress

    with progress_bar("replaying") as bar:
        def tick(done: int, total: int) -> None:
            bar(Progress(done, total, failed=0, cost_usd=0.0))

        res = run_replay(plan_path, env, out, workers=workers, replays=replays,
                         timeout=timeout, force=force, progress=tick)
    for f in res.failures[:5]:
        err_console.print(f"[red]failed:[/] {f}", highlight=False)
    total = res.costs.height + len(res.failures)
    err_console.print(
        f"{res.ran} replays run now, {res.done_before} from the log of an earlier run; "
        f"{int(res.costs['env_actions'].sum())} environment actions, "
        f"{int(res.costs['tokens'].sum())} tokens", highlight=False)
    if res.not_tried:
        err_console.print(f"[red]stopped:[/] the environment failed its first "
                          f"{len(res.failures)} replays and answered none; {res.not_tried} "
                          "not tried (fix --env and rerun)", highlight=False)
        raise typer.Exit(1)
    if res.labels is None:
        err_console.print(f"[red]{len(res.failures)} replay(s) failed[/] of {total}: no "
                          "labels written; rerun to retry them (finished ones are kept)",
                          highlight=False)
        raise typer.Exit(1)
    err_console.print(f"labels → {out / 'labels.parquet'}, cost → "
                      f"{out / 'replay_cost.parquet'}", highlight=False)


@app.command("correct")
def correct_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", parser=IN,
                                            help="The plan written before labels.")],
    labels: Annotated[Path, typer.Option("--labels", parser=IN, help="rollout_id, step, side "
                                         "(realized|resampled), sample, return.")],
    out: OutDir,
    beta: Annotated[float, typer.Option(help="Weight of the rollout's RLOO outcome advantage.")]
    = 0.0,
    rollouts: Annotated[Path | None, typer.Option(parser=IN, help="rollouts.parquet (for --beta).")]
    = None,
    steps: Annotated[Path | None, typer.Option(parser=IN, help="steps.parquet: also write token "
                                                  "advantages.")] = None,
    no_correction: Annotated[bool, typer.Option("--no-correction", metavar="",
                                                help="Use the stored "
                                                "predictions alone (the ablation).")] = False,
    clip: Annotated[float | None, typer.Option(help="Clip corrected credit to ±CLIP (breaks "
                                                  "unbiasedness; recorded).")] = None,
    force: Force = False,
) -> None:
    """Corrected credit Ĉ_t = c_t + (S_t/p_t)(Δ_t − c_t) → OUT/credit.parquet (and
    OUT/token_advantages.parquet with --steps).

    Example: draco replay correct --plan plan.parquet --labels labels.parquet -o credo
    """
    from draco_cli.credo.stage import correct_replay

    info = correct_replay(plan_path, labels, out, beta=beta, rollouts=rollouts, steps=steps,
                          no_correction=no_correction, clip=clip, force=force)
    err_console.print(
        f"{info['positions']} positions, {info['selected']} corrected from replay"
        f"{'' if info['correction'] else ' (--no-correction: predictions only)'}; "
        f"{info['labels_ignored']} labels for unselected positions ignored → {out}",
        highlight=False)


@app.command("fit")
def fit_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", parser=IN, help="Plan with selections.")],
    labels: Annotated[Path, typer.Option("--labels", parser=IN, help="Replay labels.")],
    features: Annotated[Path, typer.Option("--features", parser=IN,
                                           help="step_credit.parquet (DRACO "
                                           "features) or rollout_id, step, numeric columns.")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT, help="Heads file (JSON).")],
    rewards: Annotated[Path | None, typer.Option(parser=IN, help="rewards.parquet for the reward "
                                                    "feature.")] = None,
    rollouts: Annotated[Path | None, typer.Option(parser=IN, help="rollouts.parquet: held-out "
                                                     "calibration split by task.")] = None,
    ridge: Annotated[float, typer.Option(help="Ridge penalty of the credit head.")] = 1.0,
    holdout: Annotated[float, typer.Option(help="Share of tasks held out for calibration "
                                           "(with --rollouts).")] = 0.2,
    cross_fit: Annotated[int | None, typer.Option(
        "--cross-fit", min=2, help="Also write cross-fitted predictions (tasks in K folds, each "
        "fold predicted by heads fitted on the others) to --predictions; needs --rollouts.")]
    = None,
    predictions: Annotated[Path | None, typer.Option(
        "--predictions", help="Where --cross-fit writes rollout_id, step, prediction, error, "
        "fold, head_version (a positions table for replay plan).", parser=OUT)] = None,
    force: Force = False,
) -> None:
    """Fit the credit head (inverse-inclusion-weighted ridge of Δ) and the error head
    (non-negative regression of (Δ − c_old)²); versioned.

    Example: draco replay fit --plan plan.parquet --labels labels.parquet --features credit/step_credit.parquet -o heads.json
    """
    from draco_cli.credo.stage import fit_replay

    res = fit_replay(plan_path, labels, features, out, rewards=rewards, rollouts=rollouts,
                     ridge=ridge, holdout=holdout, folds=cross_fit, predictions=predictions,
                     force=force)
    h = res.heads
    err_console.print(f"{h.version}: {h.rows} labelled positions, features "
                      f"{', '.join(h.features)} → {out}", highlight=False)
    err_console.print(res.note, highlight=False)
    if res.calibration is not None:
        _print_table(res.calibration, "inverse-inclusion-weighted means per prediction bin")
    if res.cross_fitted is not None:
        cf = res.cross_fitted
        made, asked = cf["fold"].n_unique(), cross_fit or 0
        short = "" if made >= asked else (
            f" (of {asked} asked: tasks are split by hash, and {asked - made} "
            f"fold{'s' if asked - made != 1 else ''} got none)")
        err_console.print(f"cross-fitted predictions for {cf.height} positions over {made} "
                          f"folds{short} → {predictions}", highlight=False)


def _print_table(df: pl.DataFrame, title: str) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=None)
    for c in df.columns:
        t.add_column(c, justify="left" if df[c].dtype == str else "right")
    for row in df.iter_rows():
        t.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row])
    err_console.print(t)


@app.command("evolve")
def evolve_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", parser=IN,
                                            help="Replay plan (replay plan -o).")],
    labels: Annotated[Path, typer.Option("--labels", parser=IN, help="Replay labels.")],
    rollouts: Annotated[Path, typer.Option("--rollouts", parser=IN, help="For the split by task.")],
    baseline: Annotated[Path, typer.Option("--baseline", parser=IN,
                                           help="Features under the current "
                                           "rubric (step_credit.parquet or a features table).")],
    candidate: Annotated[list[Path], typer.Option("--candidate", help="Features under one "
                                                  "rubric edit (repeatable).", parser=IN)],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT, help="Scores (Parquet).")],
    ridge: Annotated[float, typer.Option(help="Ridge penalty of the credit head.")] = 1.0,
    holdout: Annotated[float, typer.Option(help="Share of tasks held out.")] = 0.2,
    force: Force = False,
) -> None:
    """Score rubric edits (add / remove / merge criteria, each recomputed into features) by the
    held-out variance-weighted objective and by MSE; accept the best if it beats the baseline.

    Example: draco replay evolve --plan plan.parquet --labels labels.parquet --rollouts d/rollouts.parquet --baseline sc0.parquet --candidate sc_merge.parquet -o evolve.parquet
    """
    from draco_cli.credo.stage import evolve_replay

    scores = evolve_replay(plan_path, labels, rollouts, baseline, candidate, out, ridge=ridge,
                           holdout=holdout, force=force)
    err_console.print(scores)
    best = scores.filter(scores["accepted"])
    err_console.print(f"accepted: {best['candidate'][0]}" if best.height else
                      "no edit beats the current rubric", highlight=False)


@app.command("propose")
@llm_options("base_url", "concurrency", "max_cost", "prices", "timeout")
def propose_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", parser=IN, help="The plan.")],
    labels: Annotated[Path, typer.Option("--labels", parser=IN, help="Its replay labels.")],
    rollouts: Annotated[Path, typer.Option("--rollouts", parser=IN,
                                           help="rollouts.parquet (tasks for "
                                           "the held-out split, outcomes for discrimination).")],
    steps: Annotated[Path, typer.Option("--steps", parser=IN, help="steps.parquet.")],
    rubrics: Annotated[Path, typer.Option("--rubrics", parser=IN,
                                          help="The current rubric (one set of "
                                          "criteria shared by every group, e.g. static).")],
    verdicts: Annotated[Path, typer.Option("--verdicts", parser=IN, help="Verdicts under it.")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT, help="Output folder.")],
    max_edits: Annotated[int, typer.Option("--max-edits", min=1, help="Edits asked for.")] = 3,
    evidence: Annotated[int, typer.Option("--evidence", min=1, help="Worst-predicted held-out "
                                          "steps shown to the LLM.")] = 8,
    ridge: Annotated[float, typer.Option(help="Ridge penalty of the credit head refitted per edit.")] = 1.0,
    holdout: Annotated[float, typer.Option(help="Share of tasks held out.")] = 0.2,
    force: Force = False,
    *, llm: LLMSettings,
) -> None:
    """An LLM proposes add / remove / merge rubric edits from the held-out positions the credit
    head predicts worst; each edit is judged (new criteria only, cached in the call log, phase
    evolve), recomputed into features and scored; the best is accepted only if it lowers the
    held-out variance-weighted objective → OUT/evolve.parquet, OUT/rubrics.parquet,
    OUT/verdicts.parquet. MSE and outcome discrimination (AUC) are reported alongside.

    Example: draco replay propose --plan plan.parquet --labels r/labels.parquet --rollouts d/rollouts.parquet --steps d/steps.parquet --rubrics d/rubric/rubrics.parquet --verdicts d/judge/verdicts.parquet --model openai/gpt-4.1 -o evolve
    """
    from draco_cli.cli.llmrun import progress_bar
    from draco_cli.credo.stage import propose_replay

    with progress_bar("proposing and judging edits") as bar:
        res = propose_replay(plan_path, labels, rollouts, steps, rubrics, verdicts, out, llm,
                             max_edits=max_edits, evidence=evidence, ridge=ridge,
                             holdout=holdout, force=force, progress=bar)
    _print_table(res.scores.select("candidate", "held_out_objective", "held_out_mse",
                                   "outcome_auc", "accepted", "error"),
                 "rubric edits on held-out tasks (lower objective is better)")
    for n in res.notes:
        err_console.print(n, highlight=False)
    for phase, st in res.llm_stats.items():
        from draco_cli.llm.answered import Answered, money

        err_console.print(f"LLM {phase}: {Answered.of([st])}, {st.calls} HTTP calls, "
                          f"{money(st.cost_usd, st.priced)}", highlight=False)
    err_console.print(f"accepted: {res.accepted}" if res.accepted else
                      "no edit lowers the held-out objective: the rubric stays", highlight=False)


@app.command("diagnose")
def diagnose_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", parser=IN, help="The plan.")],
    labels: Annotated[Path | None, typer.Option("--labels", parser=IN, help="Its replay labels.")]
    = None,
    heads: Annotated[list[Path] | None, typer.Option(
        "--heads", parser=IN, help="Two heads files (old then new) for predictor drift.")] = None,
    features: Annotated[Path | None, typer.Option(
        "--features", parser=IN, help="Features to compare the heads on (with --heads).")] = None,
    rewards: Annotated[Path | None, typer.Option(parser=IN,
        help="rewards.parquet, when --features is a step_credit table.")] = None,
    out: Annotated[Path | None, typer.Option("-o", "--out", parser=OUT,
                                             help="Output folder.")] = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="",
                                          help="Print the figures as JSON.")] = False,
    force: Force = False,
) -> None:
    """The measurements CREDO asks to report: importance-weight tails (max S/p, effective
    sample size), replay noise σ² vs squared prediction error (C − c)², allocator calibration
    and, given two heads, predictor drift → OUT/diagnostics.json, OUT/allocator_calibration.parquet.

    Example: draco replay diagnose --plan plan.parquet --labels replays/labels.parquet -o diag
    """
    from draco_cli.credo.stage import diagnose_replay

    d = diagnose_replay(plan_path, labels=labels, heads=heads, features=features,
                        rewards=rewards, out=out, force=force)
    for section, figures in d.report.items():
        err_console.print(f"[bold]{section}[/]: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in figures.items()), highlight=False)
    if d.calibration is not None and d.calibration.height:
        _print_table(d.calibration,
                     "allocator calibration (inverse-inclusion-weighted means per e bin)")
    if as_json:
        typer.echo(json.dumps(d.report))


@app.command("exact-check")
def exact_check_cmd(
    replays: Annotated[int, typer.Option("--replays", min=1, help="K replays per side.")] = 2,
    p_min: Annotated[float, typer.Option("--p-min", help="Smallest inclusion probability.")] = 0.05,
    sweep: Annotated[str | None, typer.Option(
        "--sweep-replays", help="Also sweep M (replays per side) under one fixed expected "
        "budget, e.g. 1,2,4: the paper asks not to treat M as a free accuracy knob.")] = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="",
                                          help="Print the rows as JSON on stdout.")]
    = False,
) -> None:
    """Enumerate a two-decision, 16-trajectory model (the shape of the paper's §4.1 check)
    exactly and show the corrected estimator's expectation equals the analytic gradient (to
    1e-9), with exact variance for uniform vs oracle square-root allocation at equal expected
    cost (the no-correction control buys the same labels and ignores them).

    Example: draco replay exact-check --replays 2
    """
    from rich.table import Table

    from draco_cli.credo.stage import exact_check_rows

    Ms = None
    if sweep:
        try:
            Ms = [int(x) for x in sweep.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter("--sweep-replays takes integers, e.g. 1,2,4") from None
    rows = exact_check_rows(replays, p_min, Ms)
    t = Table(title=f"exact enumeration vs analytic gradient dJ/dθ = {rows[0]['gradient']:.10f}"
              f" (cost: expected extra environment actions per original trajectory)",
              title_justify="left", box=None)
    for c in ("estimator", "max |E - grad|", "variance", "expected cost"):
        t.add_column(c, justify="left" if c == "estimator" else "right")
    for r in rows:
        t.add_row(r["estimator"], f"{r['max_abs_error']:.2e}", f"{r['variance']:.6f}",
                  f"{r['expected_cost']:.3f}")
    err_console.print(t)
    if as_json:
        typer.echo(json.dumps(rows))
    if any(r["estimator"].startswith("corrected") and r["max_abs_error"] > 1e-9
           for r in rows):
        err_console.print("[red]a corrected estimator is biased[/]")
        raise typer.Exit(1)