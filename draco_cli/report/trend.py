"""The report's judge-health section: the judge's pass rate against the outcome over train
steps (``draco audit judge-health`` computed from the run folders), and its flag banner."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import polars as pl

from draco_cli.report.data import Redact, Run
from draco_cli.report.html import _esc, _fig_html, _int_axis, _table

if TYPE_CHECKING:
    from draco_cli.audit.judge_health import JudgeHealth

MAX_TREND_ROWS = 40  # criteria rows shown (flagged first); the rest are counted


def judge_health_of(runs: list[Run]) -> tuple[JudgeHealth | None, str | None]:
    """Judge health over the runs when they span several train steps: (health, None), or
    (None, why not)."""
    from draco_cli.audit.health_stage import health_of_runs
    from draco_cli.errors import DracoError

    steps = {r.step for r in runs}
    if len(runs) < 2 or None in steps or len(steps) < len(runs):
        return None, ("Give the run folders of several train steps (<code>draco run "
                      "--train-step N</code>) to see the judge's pass rate against the outcome "
                      "over training.")
    try:
        return health_of_runs([r.dir for r in runs]), None
    except DracoError as exc:
        return None, f"Judge health could not be computed: {html.escape(str(exc))}"


def health_banner(h: JudgeHealth | None, redact: Redact) -> str:
    if h is None or h.flagged.height == 0:
        return ""
    names = {"run": "the run (all criteria)",
             "spot_check": "spot checks (the training judge against the gold judge)"}
    items = [f"<li><b>{names.get(r['scope']) or _esc(r['title'], redact)}"
             f"</b>: {_esc(r['reason'], redact)}</li>" for r in h.flagged.iter_rows(named=True)]
    return ("<div class='banner'><b>Judge health</b> — the judge's pass rate rises over "
            "training while the outcome does not, or while its agreement with the gold judge "
            "falls (the judge may be drifting or being gamed); see <a href='#judge-health'>"
            "Judge health</a>.<ul>" + "".join(items) + "</ul></div>")


def health_section(h: JudgeHealth | None, why_not: str | None, redact: Redact) -> str:
    import plotly.graph_objects as go

    if h is None:
        return f"<p>{why_not}</p>"
    s = h.steps
    xs = s["train_step"].to_list()
    fig = go.Figure()
    lines = [("pass_rate", "judge pass rate (all criteria)"), ("outcome_rate", "outcome rate"),
             ("agreement", "reward agrees with outcome (pairs in a group)")]
    if (s["spot_n"] > 0).any():   # draco run --spot-check
        lines.append(("spot_agreement", "agreement with the gold judge (spot checks)"))
    for col, name in lines:
        fig.add_trace(go.Scatter(x=xs, y=s[col].to_list(), mode="lines+markers", name=name))
    fig.update_layout(title="Judge pass rate against the outcome over training steps",
                      yaxis_range=[0, 1.02], legend=dict(orientation="h", y=-0.2))
    _int_axis(fig, xs)
    t = h.trends.sort(["flagged", "scope", "pass_p_holm"], descending=[True, True, False],
                      nulls_last=True)
    crit = t.filter(pl.col("scope") == "criterion")
    spot = t.filter(pl.col("scope") == "spot_check")
    shown = pl.concat([t.filter(pl.col("scope") == "run"), spot, crit.head(MAX_TREND_ROWS)])
    shown = shown.with_columns(
        pl.when(pl.col("scope") == "spot_check").then(pl.lit("(gold judge agreement)"))
        .otherwise(pl.col("title").fill_null("(all criteria)"))
        .map_elements(redact, return_dtype=pl.String).alias("title"),
        pl.col("reason").map_elements(redact, return_dtype=pl.String)).drop("criterion", "pass_t")
    rest = crit.height - min(crit.height, MAX_TREND_ROWS)
    note = (f"<p class='note'>Each train step is one observation: <b>pass_slope</b> is the "
            "weighted least-squares slope of the per-step pass rate (passes / (passes + "
            "fails)) on the train step, with its t-test on S − 2 degrees of freedom; "
            f"<b>flagged</b>: over ≥ {h.min_steps} steps the slope is positive with p < "
            f"{h.alpha} (Holm-adjusted over criteria: <b>pass_p_holm</b>) while the outcome "
            "rate of the same rollouts does not rise (its slope ≤ 0 or p ≥ "
            f"{h.alpha}). Criteria are matched across steps by normalised title. With "
            "<code>draco run --spot-check N</code>, <b>spot_agreement</b> is the share of the "
            "sampled verdicts on which the gold judge gives the training judge's verdict "
            "(<b>spot_kappa</b>: Cohen's kappa); the <i>gold judge agreement</i> row is "
            f"flagged when its slope is negative with p < {h.alpha} while the pass rate's is "
            f"positive with p < {h.alpha}. Spot checks never change the reward.</p>")
    more = (f"<p class='note'>{rest} more criteria; all of them: <code>draco audit "
            "judge-health RUN_ROOT -o OUT</code>.</p>" if rest else "")
    return (_fig_html(fig, height=400) + "<p>Per train step:</p>"
            + _table(s, {"outcome_rate": ".3f"}) + note + _table(shown, {"pass_p": ".3g",
                                                                          "pass_p_holm": ".3g",
                                                                          "outcome_p": ".3g",
                                                                          "pass_slope": ".4f",
                                                                          "outcome_slope": ".4f",
                                                                          "agreement_slope": ".4f",
                                                                          "agreement_p": ".3g"})
            + more)
