from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from draco_cli.cli.options import IN, OUT, BaseUrl, Force, folder_path
from draco_cli.cli.output import Format, Json, Report, emit, pick_format

app = typer.Typer(help="Audits: self-judge agreement, rubric overlap and statistics, cost, step labels, judge health.",
                  no_args_is_help=True)

OutOpt = Annotated[Path, typer.Option("-o", "--out", help="Output folder for Parquet tables.",
                                      callback=folder_path, parser=OUT)]
RolloutsOpt = Annotated[Path | None, typer.Option(
    "--rollouts", parser=IN, help="rollouts.parquet, for train_step and task_id.")]


@app.command("self-judge")
def self_judge(
    self_v: Annotated[list[Path], typer.Option(
        "--self", help="The candidate judge's verdicts (file or run folder; repeat it, paired "
        "with --reference, for several training steps).", parser=IN)],
    reference: Annotated[list[Path], typer.Option(
        "--reference", parser=IN, help="The reference judge's verdicts (file or run folder).")],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    self_judge_label: Annotated[str | None, typer.Option(
        "--self-judge", help="Judge label to take from --self if it holds several.")] = None,
    reference_judge: Annotated[str | None, typer.Option(
        help="Judge label to take from --reference if it holds several.")] = None,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Agreement of a self-judge with a reference judge, overall, per train step and first vs
    last quarter, with step-level tests (each train step one observation: Welch t of the
    quarters, weighted trend) → OUT/agreement.parquet, OUT/tests.parquet.

    Example: draco audit self-judge --self run/self/verdicts.parquet --reference run/gpt/verdicts.parquet --rollouts run/rollouts.parquet -o run/audit
    """
    from draco_cli.audit.stage import audit_self_judge

    shape = pick_format(fmt, as_json)
    agreement, tests = audit_self_judge(self_v, reference, out, rollouts=rollouts,
                                        self_judge=self_judge_label,
                                        reference_judge=reference_judge, force=force)
    overall = agreement.filter(agreement["scope"] == "overall").to_dicts()[0]
    emit(Report([("self-judge vs reference", agreement)] + ([("tests", tests)] if tests.height
                                                            else []),
                document={"overall": overall, "scopes": agreement.to_dicts(),
                          "tests": tests.to_dicts()}), shape)


@app.command("overlap")
def overlap(
    own: Annotated[Path, typer.Option("--own", help="Your rubric table (rubric_candidates for "
                                      "--level rollout, rubrics for --level group).", parser=IN)],
    reference: Annotated[Path, typer.Option("--reference", parser=IN,
                                            help="The reference rubric table.")],
    out: OutOpt,
    fmt: Format = None,
    as_json: Json = False,
    level: Annotated[Literal["rollout", "group"], typer.Option(
        help="rollout (generation) or group (merge).")] = "group",
    matcher: Annotated[Literal["lexical", "embedding", "llm"], typer.Option(
        help="lexical (offline), embedding or llm.")]
    = "lexical",
    model: Annotated[str | None, typer.Option(
        help="Matcher model: provider/model for llm, openai/EMBEDDING for embedding.")] = None,
    base_url: BaseUrl = None,
    threshold: Annotated[float, typer.Option(help="Similarity that counts as a match "
                                             "(lexical, embedding).")] = 0.5,
    rollouts: RolloutsOpt = None,
    force: Force = False,
) -> None:
    """Recall and precision of your rubric writer against a reference, matched one-to-one,
    per train step and overall, with the reference's ceiling → OUT/overlap*.parquet.

    Example: draco audit overlap --own self/rubrics.parquet --reference gpt/rubrics.parquet --level group --rollouts d/rollouts.parquet -o audit
    """

    from draco_cli.audit.stage import audit_overlap

    summary, _ = audit_overlap(own, reference, out, level=level, matcher=matcher, model=model,
                               base_url=base_url, threshold=threshold, rollouts=rollouts,
                               force=force)
    emit(Report([(f"overlap ({level} level, {matcher} matcher)", summary)],
                keys=["overlap"]), pick_format(fmt, as_json))


@app.command("rubric")
def rubric(
    rubrics: Annotated[Path, typer.Option("--rubrics", parser=IN, help="rubrics.parquet.")],
    verdicts: Annotated[Path, typer.Option("--verdicts", parser=IN,
                                           help="Aggregated verdicts.parquet.")],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    judge: Annotated[str | None, typer.Option(help="Judge label, if several.")] = None,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Rubric statistics: discriminative share, criteria per group, single-task criteria and
    their share of judgments, na rate per criterion (worst first), failure share of verdicts.

    Example: draco audit rubric --rubrics d/rubric/rubrics.parquet --verdicts d/judge/verdicts.parquet --rollouts d/rollouts.parquet -o audit
    """
    from draco_cli.audit.stage import audit_rubric

    summary, per = audit_rubric(rubrics, verdicts, out, rollouts=rollouts, judge=judge,
                                force=force)
    shape = pick_format(fmt, as_json)
    emit(Report([("rubric statistics", summary),
                 ("na rate per criterion (worst 10)" if shape == "table" else "criteria",
                  per.select("title", "judgments", "na_rate", "fails", "passes").head(10)
                  if shape == "table" else per)], keys=["summary", "criteria"]), shape)


@app.command("cost")
def cost(
    calls: Annotated[list[Path], typer.Option("--calls", help="Call log (llm_calls.sqlite or "
                                              "its Parquet export) or a draco run folder; "
                                              "repeat it for several training steps.", parser=IN)],
    out: OutOpt,
    rollouts: RolloutsOpt = None,
    replay_cost: Annotated[list[Path] | None, typer.Option(parser=IN,
        help="replay_cost.parquet of `draco replay run` (or its folder); "
        "repeatable. Adds replay and reconstruction rows to the cost by category.")] = None,
    steps: Annotated[Path | None, typer.Option(parser=IN,
        help="steps.parquet: the original rollouts' actions and tokens.")] = None,
    prices: Annotated[Path | None, typer.Option(parser=IN,
        help="Price table JSON for the naive client's dollars (default: the shipped one).")]
    = None,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Calls, tokens and dollars per phase and per train step, and the projection per 100
    training steps → OUT/cost_phase.parquet, OUT/cost_step.parquet; cost by category
    (original, replay, reconstruction, judge, rubric writing, candidate scoring: tokens,
    environment actions, dollars) → OUT/cost_category.parquet; billed tokens and dollars next
    to a naive client's (one call per sample, no prompt caching, no batch discount) →
    OUT/cost_naive.parquet, a row per phase and route: the calls sent online, those sent
    through a batch API (half price) and all.

    Example: draco audit cost --calls runs/step-0 --calls runs/step-1 -o audit
    """

    from draco_cli.audit.stage import audit_cost

    c = audit_cost(calls, out, rollouts=rollouts, replay_cost=replay_cost, steps=steps,
                   prices=prices, force=force)
    per_phase, per_step, by_cat, naive = c.per_phase, c.per_step, c.by_category, c.naive
    total, projected = c.total_usd, c.projected_per_100_steps
    emit(Report([("cost by category", by_cat), ("cost per phase", per_phase),
                 ("billed vs a naive client (k calls, no caching, no batch); online and batch "
                  "calls apart", naive)]
                + ([("cost per train step", per_step)] if per_step.height else []),
                document={"per_phase": per_phase.to_dicts(), "per_step": per_step.to_dicts(),
                          "by_category": by_cat.to_dicts(), "billed_vs_naive": naive.to_dicts(),
                          "total_usd": total, "projected_usd_per_100_steps": projected},
                lines=[_cost_line(total, projected)]),
         pick_format(fmt, as_json))


@app.command("step-labels")
def step_labels(
    rollouts: Annotated[Path, typer.Option("--rollouts", parser=IN, help="The folder draco "
                                           "ingest wrote (rollouts, steps and, from "
                                           "agentprocessbench, step_labels).")],
    labels: Annotated[list[str] | None, typer.Option(
        "--labels", help="More labels: a step_labels table or a judge's results file in "
        "AgentProcessBench's format (auto-detected); NAME=PATH names the labeler. Repeatable.")]
    = None,
    run: Annotated[Path | None, typer.Option("--run", parser=IN, help="A draco run folder on "
                                             "these rollouts: its credit is audited and its "
                                             "advantages used.")] = None,
    out: Annotated[Path | None, typer.Option("-o", "--out", parser=OUT, help="Output folder "
                                             "(default RUN/audit, or ROLLOUTS/audit).")] = None,
    human: Annotated[str, typer.Option(help="The labeler whose labels are the truth.")]
    = "human",
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap and the random control.")]
    = 0,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap draws (groups resampled).")] = 1000,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Where credit lands against human step labels: AUROC of step quality, the share of a
    loser's negative push on −1 steps and of a winner's positive push on +1 steps (beside
    uniform credit), worst-step hit rate; for the run, uniform credit, each labeler's labels
    as verdicts and a random-citation control, with group-bootstrap 95% intervals →
    OUT/step_label_audit.parquet.

    Example: draco audit step-labels --rollouts data/hotpotqa --labels gpt=hotpotqa__blind_gpt-5.2.jsonl --run runs/hotpotqa
    """
    from draco_cli.audit.stage import audit_step_labels
    from draco_cli.cli.console import err_console

    r = audit_step_labels(rollouts, list(labels or []), run=run, out=out, human=human,
                          seed=seed, draws=bootstrap, force=force)
    emit(Report([(f"step-label audit ({r.rollouts} labelled rollouts; truth: {human})",
                  r.figures)], keys=["figures"]), pick_format(fmt, as_json))
    err_console.print(f"wrote {r.out}/step_label_audit.parquet", highlight=False)


@app.command("judge-health")
def judge_health(
    runs: Annotated[list[Path], typer.Argument(
        metavar="RUN_ROOT_OR_RUN_DIR...", parser=IN,
        help="Run folders of several train steps (draco run --train-step N), or the folder "
        "that holds them.")],
    out: OutOpt,
    judge: Annotated[str | None, typer.Option(help="Judge label, if the runs hold several.")]
    = None,
    match: Annotated[Literal["title", "id"], typer.Option(
        help="How criteria are matched across steps: title (normalised; dynamic rubrics "
        "write new ids per group) or id.")] = "title",
    alpha: Annotated[float, typer.Option(help="Level of the trend tests behind a flag.")]
    = 0.05,
    min_steps: Annotated[int, typer.Option(help="Steps a criterion needs to be tested.")] = 3,
    fmt: Format = None,
    as_json: Json = False,
    force: Force = False,
) -> None:
    """Judge health over training: per train step and per criterion, the judge's pass rate
    beside the outcome rate of the rollouts judged, and the reward's agreement with the
    outcome; step-level trends (each train step one observation: weighted least-squares slope
    and its t-test); a flag where the pass rate rises (p < alpha; Holm over criteria) while the
    outcome does not; with draco run --spot-check, the agreement with the gold judge per step
    (share and Cohen's kappa) and a flag where it falls while the pass rate rises →
    OUT/judge_health_{steps,criteria,trends}.parquet.

    Example: draco audit judge-health runs/ -o runs/health
    """
    from draco_cli.audit.health_stage import audit_judge_health

    h = audit_judge_health(runs, out, judge=judge, match=match, alpha=alpha,
                           min_steps=min_steps, force=force)
    flagged = h.flagged
    shape = pick_format(fmt, as_json)
    trends = h.trends.select("scope", "title", "n_steps", "pass_rate_first", "pass_rate_last",
                             "pass_slope", "pass_p", "pass_p_holm", "outcome_slope",
                             "outcome_p", "flagged") if shape == "table" else h.trends
    run_row = h.trends.filter(h.trends["scope"] == "run").to_dicts()[0]
    lines = [f"flagged: {'the run' if run_row['flagged'] else 'not the run'}; "
             f"{int((flagged['scope'] == 'criterion').sum())} of "
             f"{int((h.trends['scope'] == 'criterion').sum())} criteria "
             f"(pass rate rises with p < {alpha} while the outcome does not)",
             f"run: {run_row['reason']}"]
    spot = h.trends.filter(h.trends["scope"] == "spot_check").to_dicts()
    lines += [f"spot checks: {spot[0]['reason']}"] if spot else []
    emit(Report([("judge health per train step", h.steps), ("trends", trends)],
                document={"steps": h.steps.to_dicts(), "trends": h.trends.to_dicts(),
                          "criteria": h.criteria.to_dicts(), "alpha": alpha,
                          "min_steps": min_steps, "flagged_run": run_row["flagged"],
                          "flagged_criteria": flagged.filter(
                              flagged["scope"] == "criterion")["criterion"].to_list(),
                          "flagged_spot_check": bool(spot and spot[0]["flagged"])},
                lines=lines), shape)


def _cost_line(total: float | None, projected: float | None) -> str:
    if total is None:
        return "total unpriced (the model is not in the price table; --prices FILE)"
    return f"total ${total:.4f}" + (f"; projected per 100 steps ${projected:.2f}"
                                    if projected is not None else "")
