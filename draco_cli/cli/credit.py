from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.output import Format, Json, Report, emit, pick_format
from draco_cli.cli.options import IN, OUT, Force, OutDir, Steps, credit_option
from draco_cli.choices import CreditKind, Drop, Estimator, RewardSource, StdMode, TokenForm

if TYPE_CHECKING:
    from draco_cli.credit import CreditStats

app = typer.Typer(help="Rewards, group advantages, step credit and token advantages.",
                  no_args_is_help=True)


RolloutsOpt = Annotated[Path, typer.Option("--rollouts", parser=IN,
                                           help="rollouts.parquet (or - for stdin).")]
VerdictsOpt = Annotated[Path | None, typer.Option(
    "--verdicts", parser=IN, help="Aggregated verdicts.parquet (not needed with --reward "
    "outcome).")]
DropOpt = Annotated[Drop, credit_option(
    help="Which criteria the discriminative filter drops: all-pass (no member failed) or also "
    "constant (every answered member failed).")]
JudgeOpt = Annotated[str | None, credit_option(
    help="Judge label to use when the verdicts hold several judges.")]
RubricDropoutOpt = Annotated[float, credit_option(
    help="Leave this seeded share (0 ≤ P < 1) of each group's retained criteria out of the "
    "reward and credit, a group keeping at least one; written to rubric_dropout.parquet.")]
DropoutSeedOpt = Annotated[int, credit_option(help="Seed of --rubric-dropout.")]


@app.command("compute")
def compute(
    rollouts: RolloutsOpt,
    steps: Steps,
    out: OutDir,
    verdicts: VerdictsOpt = None,
    credit: Annotated[CreditKind | None, credit_option(
        help="step: DRACO step credit; uniform: every policy token gets A_i (the w/o-credit "
        "ablation). Default: step, or uniform with --reward outcome.")] = None,
    estimator: Annotated[Estimator, credit_option(
        help="grpo: standardised within the group; rloo: r_i minus the mean of the others.")]
    = "grpo",
    std: Annotated[StdMode, credit_option(
        help="GRPO's std: sample (verl), population, or none (Dr. GRPO).")] = "sample",
    drop: DropOpt = "all-pass",
    tokens: Annotated[TokenForm, credit_option(help="Token-advantage form to write.")] = "spans",
    reward: Annotated[RewardSource, credit_option(
        help="rubric: pass fraction of retained criteria; outcome: the environment's outcome "
        "(vanilla GRPO: implies --credit uniform, needs no verdicts).")] = "rubric",
    judge: JudgeOpt = None,
    rubric_dropout: RubricDropoutOpt = 0.0,
    dropout_seed: DropoutSeedOpt = 0,
    train_step: Annotated[int | None, credit_option(
        help="The train step token advantages name for rollouts that do not say theirs (a "
        "trainer's loader checks it).")] = None,
    allow_no_signal: Annotated[bool, typer.Option(
        "--allow-no-signal", metavar="", help="Exit 0 for a step that gives the trainer no "
        "learning signal (every advantage 0); without it that is exit 1, the tables written.")]
    = False,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Rewards, advantages and step credit → OUT/rewards.parquet, OUT/step_credit.parquet,
    OUT/token_advantages.parquet.

    Example: draco credit compute --rollouts run/rollouts.parquet --steps run/steps.parquet
    --verdicts run/verdicts.parquet -o run/credit
    """
    from draco_cli.options import CreditOptions
    from draco_cli.credit import credit_compute

    shape = pick_format(fmt, as_json)
    outcome = reward == "outcome"
    options = CreditOptions.build(
        credit=credit or ("uniform" if outcome else "step"),
        estimator=estimator, std=std, drop=drop, tokens=tokens, reward=reward, judge=judge,
        rubric_dropout=rubric_dropout, dropout_seed=dropout_seed, train_step=train_step)
    with err_console.status("computing credit…"):
        stats = credit_compute(rollouts, steps, verdicts, out, options=options, force=force)
    if outcome and credit is None:
        err_console.print("--reward outcome: uniform credit (every policy token gets A_i)"
                          + ("" if verdicts is not None else " and no criteria filter (no "
                             "verdicts)") + "; pass --credit step with --verdicts to spread it "
                          "over steps by the judge's citations", highlight=False)
    _summary(stats, out, shape, options.reward)
    from dataclasses import asdict

    from draco_cli.run.health import credit_signal_problem

    problem = credit_signal_problem(asdict(stats), options.reward)
    if problem and not allow_no_signal:
        err_console.print(f"[red]no learning signal:[/] {problem} (--allow-no-signal accepts "
                          "such a step)", highlight=False)
        raise typer.Exit(1)


def _summary(stats: CreditStats, out: Path, fmt: str = "table", reward: str = "rubric"
             ) -> None:
    from dataclasses import asdict

    from rich.console import Console
    from rich.table import Table

    if fmt != "table":
        import polars as pl

        doc = asdict(stats)
        emit(Report([("credit", pl.DataFrame([{k: v for k, v in doc.items()
                                               if k != "credit_modes"}]))], document=doc), fmt)
        return

    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_row("groups / rollouts", f"{stats.groups} / {stats.rollouts}")
    if stats.criteria_kept or stats.criteria_dropped or reward == "rubric":
        t.add_row("criteria kept / dropped", f"{stats.criteria_kept} / {stats.criteria_dropped}")
    if stats.criteria_dropout:
        t.add_row("left out by --rubric-dropout", f"{stats.criteria_dropout} of the kept")
    t.add_row("credit modes", ", ".join(f"{k} {v}" for k, v in stats.credit_modes.items()))
    if stats.citations_dropped:
        t.add_row("citations dropped", f"{stats.citations_dropped} (outside 1..M)")
    def num(x: float | None) -> str:
        return "—" if x is None else f"{x:.4f}"

    t.add_row("advantage range", f"{num(stats.advantage_min)} .. {num(stats.advantage_max)}")
    if reward == "outcome":
        t.add_row("mean reward (environment outcome)", num(stats.mean_reward))
    else:
        t.add_row("mean reward (filtered)", num(stats.mean_reward))
    if stats.mean_pass_rate_all is not None or reward == "rubric":
        t.add_row("mean pass rate (unfiltered)", num(stats.mean_pass_rate_all))
    if stats.null_rewards:
        t.add_row("rollouts without reward", f"{stats.null_rewards} (advantage 0)")
    Console(highlight=False).print(t)
    err_console.print(f"[green]wrote[/] {out}/rewards.parquet, step_credit.parquet, "
                      "token_advantages.parquet", highlight=False)


@app.command("expand")
def expand(
    token_advantages: Annotated[Path, typer.Option("--token-advantages",
                                                   parser=IN, help="token_advantages.parquet.")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=OUT,
                                      help="Output file (- for stdout).")],
    rollouts: Annotated[Path | None, typer.Option(parser=IN,
        help="rollouts.parquet, to check every rollout is present.")] = None,
    to: Annotated[TokenForm | None, typer.Option(
        help="Target form; default: the other one.")] = None,
    force: Force = False,
) -> None:
    """Convert token advantages between the spans and dense forms, exactly.

    Example: draco credit expand --token-advantages run/credit/token_advantages.parquet -o dense.parquet
    """
    from draco_cli.credit import credit_expand

    form = credit_expand(token_advantages, out, rollouts=rollouts,
                         to=to, force=force)
    err_console.print(f"[green]wrote[/] {out} ({form} form)", highlight=False)
