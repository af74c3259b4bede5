"""The report's sections: health banner, per-step agreement, distributions, criteria, unanswered shares, trends, cost."""

from __future__ import annotations

import html
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection
from draco_cli.report.data import Redact, Run, _frame, _q, _titles, _views
from draco_cli.report.html import _esc, _fig_html, _int_axis, _table

MAX_GROUP_STRIPS = 24  # above this many groups, histograms replace per-group strips


MAX_CRITERIA_ROWS = 300  # criteria rows in the table; the rest are counted


HISTOGRAM_BINS = 30


def _banner(runs: list[Run], redact: Redact, unanswered: list[str]) -> str:
    notice = "" if not unanswered else (
        "<div class='notice'><b>Unanswered requests</b> — these count as neither pass nor "
        "fail; see <a href='#unanswered'>Answered requests</a>.<ul>"
        + "".join(f"<li>{html.escape(w)}</li>" for w in unanswered) + "</ul></div>")
    items, silent = [], []
    for r in runs:
        health = r.manifest.get("health")
        if not isinstance(health, dict):
            continue
        signal = health.get("signal") or {}
        if signal.get("problem"):   # no learning signal, failed or allowed: said either way
            silent.append(f"<li><b>{html.escape(r.label)}</b>: "
                          f"{_esc(signal['problem'], redact)}</li>")
        if health.get("ok", True):
            continue
        msgs = [m for m in health.get("messages") or ["the health check failed"]
                if m != signal.get("problem")]
        items += [f"<li><b>{html.escape(r.label)}</b>: {_esc(m, redact)}</li>" for m in msgs]
    if silent:
        notice += ("<div class='banner'><b>No learning signal</b> — every advantage the "
                   f"trainer gets from these steps is zero or nearly so.<ul>{''.join(silent)}"
                   "</ul></div>")
    if not items:
        return notice
    return notice + ("<div class='banner'><b>Health check failed</b> — the judge or rubric writer left "
            "too many requests unanswered; rewards and credit below rest on what was answered."
            f"<ul>{''.join(items)}</ul></div>")


def _per_step(con: DuckDBPyConnection, runs: list[Run]) -> tuple[pl.DataFrame, str]:
    """One row per run: rollouts, rewards, outcome, the rubric reward's agreement with the
    environment outcome, unanswered verdicts, calls and dollars."""
    views = _views(con)
    rows = {str(r.dir): {"run": r.label} for r in runs}
    frames = []   # each a figure or two per run, merged into its row
    if {"rewards", "rollouts"} <= views:
        for r in runs:
            # one run at a time, joined on the rollout id alone: the join's rows carry no run
            one = _q(str(r.dir))
            j = f"""(SELECT rw.group_id, rw.rollout_id, rw.reward, ro.outcome
                     FROM (SELECT group_id, rollout_id, reward FROM rewards WHERE run = {one}) rw
                     JOIN (SELECT rollout_id, outcome FROM rollouts WHERE run = {one}) ro
                     USING (rollout_id))"""
            frames.append(_frame(con, f"""
                SELECT {one} AS run, count(*) AS rollouts, avg(reward) AS mean_reward,
                       avg(outcome) AS mean_outcome, corr(reward, outcome) AS correlation
                FROM {j} HAVING count(*) > 0"""))
            # Within a group (all GRPO sees) the rubric should rank an episode that succeeded
            # above one that failed: the share of such pairs it orders the same way, ties half.
            frames.append(_frame(con, f"""
                WITH j AS (SELECT * FROM {j} WHERE reward IS NOT NULL AND outcome IS NOT NULL)
                SELECT {one} AS run, count(*) AS pairs,
                       avg(CASE WHEN a.reward = b.reward THEN 0.5
                                WHEN (a.reward - b.reward) * (a.outcome - b.outcome) > 0
                                THEN 1.0 ELSE 0.0 END) AS agreement
                FROM j a JOIN j b ON a.group_id = b.group_id
                     AND a.rollout_id < b.rollout_id AND a.outcome <> b.outcome
                HAVING count(*) > 0"""))
    if "verdicts" in views:
        frames.append(_frame(con, "SELECT run, avg((verdict IS NULL)::INT) AS "
                                  "unanswered_verdicts FROM verdicts GROUP BY 1"))
    if "call_totals" in views and "cost_usd" in _frame(con, "DESCRIBE call_totals")["column_name"]:
        frames.append(_frame(con, "SELECT run, sum(n_rows)::BIGINT AS calls, sum(cost_usd) "
                                  "AS cost_usd FROM call_totals GROUP BY 1"))
    for frame in frames:
        for row in frame.iter_rows(named=True):
            rows[row["run"]].update({k: v for k, v in row.items() if k != "run"})
    schema = {"run": pl.String, "rollouts": pl.Int64, "mean_reward": pl.Float64,
              "mean_outcome": pl.Float64, "agreement": pl.Float64, "pairs": pl.Int64,
              "correlation": pl.Float64, "unanswered_verdicts": pl.Float64, "calls": pl.Int64,
              "cost_usd": pl.Float64}
    df = pl.DataFrame([{c: r.get(c) for c in schema} for r in rows.values()], schema=schema)
    note = ("<p class='note'><b>agreement</b>: of the pairs of episodes in one group where one "
            "succeeded and one did not (<b>pairs</b>), the share the rubric reward orders the "
            "same way as the environment's outcome (ties count half; 0.5 is chance). It falling "
            "over training while the reward rises is the reward-hacking signal. "
            "<b>correlation</b>: Pearson's r of reward and outcome over all rollouts.</p>")
    return df, _table(df, {"cost_usd": ".4f"}) + note


def _distributions(rw: pl.DataFrame | None, n_groups: int) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if rw is None or rw.height == 0:
        return "<p>No rewards in this run.</p>"
    if n_groups > MAX_GROUP_STRIPS:
        # too many groups for a strip each: the distributions over all rollouts
        fig = make_subplots(rows=1, cols=2, subplot_titles=(
            "rubric reward", "advantage A<sub>i</sub>"))
        for col, (name, c) in enumerate((("reward", "#1f77b4"), ("advantage", "#d62728")), 1):
            # binned here, not in the browser: the page carries 30 bars, not every rollout
            counts, edges = np.histogram(rw[name].drop_nulls().to_numpy(), bins=HISTOGRAM_BINS)
            fig.add_trace(go.Bar(x=((edges[:-1] + edges[1:]) / 2).tolist(), y=counts.tolist(),
                                 width=float(edges[1] - edges[0]) or None, marker_color=c,
                                 name=name, showlegend=False,
                                 customdata=list(zip(edges[:-1].tolist(), edges[1:].tolist())),
                                 hovertemplate="%{customdata[0]:.3f} to %{customdata[1]:.3f}: "
                                 "%{y} rollouts<extra></extra>"), row=1, col=col)
        fig.update_yaxes(title="rollouts", row=1, col=1)
        fig.update_layout(title=f"Reward and advantage over {rw.height} rollouts in "
                          f"{n_groups} groups", bargap=0.05)
        return _fig_html(fig, height=400, top=90)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "rubric reward per group", "advantage A<sub>i</sub> per group"))
    for col, (name, c) in enumerate((("reward", "#1f77b4"), ("advantage", "#d62728")), 1):
        d = rw.filter(pl.col(name).is_not_null())
        # every rollout as a point (groups hold a handful: a box of 4 points says nothing)
        fig.add_trace(go.Box(x=d["group_id"].to_list(), y=d[name].to_list(),
                             text=d["rollout_id"].to_list(), boxpoints="all", jitter=0.4,
                             pointpos=0, fillcolor="rgba(0,0,0,0)",
                             line=dict(color="rgba(0,0,0,0)"), marker=dict(color=c, size=8),
                             hovertemplate="%{text}<br>%{y:.3f}<extra></extra>",
                             name=name, showlegend=False), row=1, col=col)
        means = d.group_by("group_id", maintain_order=True).agg(pl.col(name).mean())
        fig.add_trace(go.Scatter(x=means["group_id"].to_list(), y=means[name].to_list(),
                                 mode="markers", marker=dict(symbol="line-ew-open", size=34,
                                                             color="#333", line_width=2),
                                 name="group mean", showlegend=col == 1,
                                 hovertemplate="mean %{y:.3f}<extra></extra>"), row=1, col=col)
    fig.update_layout(title="Each rollout's reward and advantage, by group (bar: group mean)")
    return _fig_html(fig, height=420, top=90)


def _criteria(run: Run, con: DuckDBPyConnection, counts: str | None, redact: Redact) -> str:
    if counts is None:
        return "<p>No verdicts in this run.</p>"
    total, kept, out = _frame(con, "SELECT count(*) AS n, count(*) FILTER (WHERE retained) AS "
                                   f"kept, count(*) FILTER (WHERE dropout) AS out FROM {counts}"
                                   ).row(0)
    if total == 0:
        return "<p>No verdicts in this run.</p>"
    # A large run has a row per group and criterion (tens of thousands): the page shows the
    # first MAX_CRITERIA_ROWS in group order and counts the rest.
    head = _frame(con, f"SELECT * EXCLUDE (stored) FROM {counts} ORDER BY group_id NULLS "
                       f"FIRST, criterion_id NULLS FIRST LIMIT {MAX_CRITERIA_ROWS}")
    per = head.with_columns(
        pl.when(pl.col("retained")).then(pl.lit("kept")).when(pl.col("dropout"))
        .then(pl.lit("left out")).otherwise(pl.lit("dropped")).alias("filter"),
        (pl.col("pass") / (pl.col("pass") + pl.col("fail"))).fill_nan(None).alias("pass_rate"))
    shown = _titles(run, con, per)
    shown = shown.rename({"group_id": "group"}).with_columns(
        pl.col("title").map_elements(redact, return_dtype=pl.String).alias("criterion")
    ).sort("group", "filter", "pass_rate", descending=[False, True, False])
    rows = []
    for r in shown.iter_rows(named=True):
        rate = r["pass_rate"]
        bar = "" if rate is None else (f"<span class='bar'><span style='width:{100 * rate:.0f}%'>"
                                       "</span></span>")
        rows.append(
            f"<tr class='{'kept' if r['filter'] == 'kept' else 'dropped'}'>"
            f"<td>{html.escape(str(r['group']))}</td>"
            f"<td>{html.escape(r['criterion'])}</td><td>{r['filter']}</td>"
            f"<td class='num'>{'—' if rate is None else f'{rate:.0%}'} {bar}</td>"
            f"<td class='num'>{r['pass']}</td><td class='num'>{r['fail']}</td>"
            f"<td class='num'>{r['na']}</td><td class='num'>{r['unanswered']}</td></tr>")
    rest = total - shown.height
    more = (f"<p class='note'>The first {shown.height} of {total} criteria (by group) are "
            f"shown; {rest} more, of which {kept - int((shown['filter'] == 'kept').sum())} kept. "
            "All of them: <code>draco sql RUN \"SELECT * FROM verdicts\"</code>.</p>"
            if rest else "")
    left_out = f", {out} left out of the reward by --rubric-dropout" if out else ""
    return (f"<p>{kept} criteria kept, {total - kept - out} dropped by the discriminative "
            "filter (no member of the group failed them, so they cannot tell members apart)"
            f"{left_out}. Pass rate = passes / (passes + fails) over the group's rollouts.</p>"
            f"<details{' open' if total <= 60 else ''}><summary>{total} criteria"
            "</summary><table><tr><th>group</th>"
            f"<th>criterion</th><th>filter (kept / dropped{' / left out' if out else ''})</th>"
            "<th>pass rate</th><th>pass</th>"
            "<th>fail</th><th>na</th><th>unanswered</th></tr>" + "".join(rows)
            + "</table>" + more + "</details>")


def _unanswered(runs: list[Run], con: DuckDBPyConnection) -> tuple[str, list[str]]:
    """Each stage's answered figure (from the run's health record, else from its call log),
    and a warning line for each stage that left requests unanswered."""
    from draco_cli.llm.answered import Answered
    from draco_cli.run.health import stage_figure

    rows: list[tuple[str, str, Answered, str]] = []
    from_health = set()
    for r in runs:
        health = r.manifest.get("health")
        stages = health.get("stages") if isinstance(health, dict) else None
        if isinstance(stages, dict) and stages:
            for stage, s in stages.items():
                figure = stage_figure(s) if isinstance(s, dict) else None
                if figure is None:
                    continue
                reasons = ", ".join(f"{k} ×{v}" for k, v in (s.get("reasons") or {}).items())
                from_health.add(str(r.dir))
                rows.append((r.label, stage, figure, reasons or "—"))
    if "call_totals" in _views(con):
        labels = {str(r.dir): r.label for r in runs}
        got = _frame(con, """SELECT run, phase, sum(n_rows)::BIGINT AS calls,
                                    sum(CASE WHEN status = 'ok' THEN n_rows ELSE 0 END)::BIGINT
                                        AS answered,
                                    string_agg(CASE WHEN status <> 'ok' THEN status END, ', '
                                               ORDER BY status) AS reasons
                             FROM call_totals GROUP BY 1, 2 ORDER BY 1, 2""")
        # no health record (a folder of `draco judge`, say): the log's rows are all there is,
        # and a re-asked request has several, so the unit says rows, not requests
        for x in got.filter(~pl.col("run").is_in(list(from_health))).iter_rows(named=True):
            rows.append((labels.get(x["run"], x["run"]), x["phase"],
                         Answered(x["answered"], x["calls"], "call-log rows"),
                         x["reasons"] or "—"))
    if not rows:
        return "<p>No LLM calls logged.</p>", []
    df = pl.DataFrame([{"run": run, "stage": stage, "answered": str(f), "reasons": why}
                       for run, stage, f, why in rows],
                      schema={"run": pl.String, "stage": pl.String, "answered": pl.String,
                              "reasons": pl.String})
    warnings = [f"{run}: {stage} {f} ({why})" for run, stage, f, why in rows
                if f.answered < f.requests]
    return ("<p>Each stage's requests (one per sample of each prompt, answers reused from the "
            "call log included) and how many were answered; an unanswered verdict counts as "
            "neither pass nor fail.</p>" + _table(df), warnings)


def _over_steps(runs: list[Run], con: DuckDBPyConnection, summary: pl.DataFrame) -> str:
    import plotly.graph_objects as go

    from draco_cli.evaluate.core import evaluate

    if len(runs) < 2:
        return ("<p>Give several run folders (one per training step, e.g. "
                "<code>draco report runs/step-*</code>) to see trends.</p>")
    parts = []
    xs = [r.step if r.step is not None else i for i, r in enumerate(runs)]
    if "rollouts" in _views(con):
        ph: dict[Any, list[float | None]] = {}   # pass^k per k (evaluate's summary: JSON)
        term: dict[str, list[float]] = {}
        for i, r in enumerate(runs):
            ro = _frame(con, f"SELECT * EXCLUDE (run) FROM rollouts WHERE run = {_q(str(r.dir))}")
            if ro.height == 0:
                continue
            res = evaluate(ro, [1, 2, 3])
            for k, v in res.summary["pass_hat_k"].items():
                ph.setdefault(k, [None] * len(runs))[i] = v
            for mode, share in res.summary["termination_shares"].items():
                term.setdefault(mode, [0.0] * len(runs))[i] = share
        fig = go.Figure([go.Scatter(x=xs, y=v, mode="lines+markers", name=f"pass^{k}")
                         for k, v in ph.items()])
        fig.update_layout(title="pass^k over training steps", yaxis_range=[0, 1.02])
        _int_axis(fig, xs)
        parts.append(_fig_html(fig))
        fig = go.Figure([go.Bar(x=xs, y=v, name=m) for m, v in sorted(term.items())])
        fig.update_layout(barmode="stack", title="Termination modes over training steps",
                          yaxis_title="share of rollouts")
        _int_axis(fig, xs)
        parts.append(_fig_html(fig))
    fig = go.Figure()
    for col, name in (("agreement", "rubric reward agrees with outcome (pairs in a group)"),
                      ("correlation", "correlation of reward and outcome"),
                      ("mean_reward", "mean rubric reward"), ("mean_outcome", "mean outcome")):
        fig.add_trace(go.Scatter(x=xs, y=summary[col].to_list(), mode="lines+markers",
                                 name=name, line=dict(dash="dot") if col.startswith("mean")
                                 else None))
    fig.update_layout(title="Does the rubric reward still track the environment's outcome?",
                      legend=dict(orientation="h", y=-0.2))
    _int_axis(fig, xs)
    parts.append(_fig_html(fig, height=400))
    if "agreement" in _views(con):
        a = _frame(con, "SELECT scope, agreement, false_pass_rate, false_fail_rate FROM agreement "
                        "WHERE starts_with(scope, 'step:')")
        if a.height:
            a = a.with_columns(pl.col("scope").str.replace("step:", "").cast(pl.Int64)
                               .alias("step")).unique("step").sort("step")
            fig = go.Figure([go.Scatter(x=a["step"].to_list(), y=a[c].to_list(),
                                        mode="lines+markers", name=c)
                             for c in ("agreement", "false_pass_rate", "false_fail_rate")])
            fig.update_layout(title="Self-judge vs reference judge over training steps")
            _int_axis(fig, a["step"].to_list())
            parts.append(_fig_html(fig))
    return "".join(parts)


def _cost(runs: list[Run], con: DuckDBPyConnection) -> str:
    import plotly.graph_objects as go

    if "call_totals" not in _views(con):
        return "<p>No LLM calls logged.</p>"
    c = _frame(con, """SELECT run, phase, sum(n_rows)::BIGINT AS calls,
                              sum(cost_usd) AS cost_usd
                       FROM call_totals GROUP BY 1, 2 ORDER BY 1, 2""")
    if c.height == 0:
        return "<p>No LLM calls logged.</p>"
    order = {str(r.dir): (r.step if r.step is not None else i) for i, r in enumerate(runs)}
    c = c.with_columns(pl.col("run").replace_strict(order, return_dtype=pl.Int64).alias("x"))
    xs = sorted(set(c["x"].to_list()))
    unpriced = c["cost_usd"].null_count() == c.height
    total = float(c["cost_usd"].fill_null(0.0).sum())
    # replayed, self-hosted or unpriced calls: then the calls themselves are the cost
    y, unit = ("cost_usd", "USD") if total > 0 else ("calls", "calls")
    fig = go.Figure()
    for phase in sorted(set(c["phase"].to_list())):
        p = c.filter(pl.col("phase") == phase)
        fig.add_trace(go.Bar(x=p["x"].to_list(), y=p[y].to_list(), name=phase,
                             customdata=p[["calls", "cost_usd"]].rows(),
                             hovertemplate="%{x}: %{customdata[0]} calls, unpriced"
                             if unpriced else "%{x}: $%{customdata[1]:.4f}, %{customdata[0]} "
                             "calls"))
    title = (f"Dollars per training step, by phase (total ${total:.4f})" if total > 0 else
             "Calls per training step, by phase (unpriced model: its cost is unknown; "
             "--prices FILE prices it)" if unpriced else
             "Calls per training step, by phase (no dollars logged: replayed or free calls)")
    fig.update_layout(barmode="stack", title=title, yaxis_title=unit, yaxis_rangemode="tozero")
    _int_axis(fig, xs)
    from draco_cli.audit.cost import _dollars   # here: draco_cli.audit loads scipy

    table = c.group_by("phase").agg(pl.col("calls").sum(), _dollars()).sort("phase")
    return (_fig_html(fig) + "<p>Calls and dollars per phase, all steps:</p>"
            + _table(table, {"cost_usd": ".4f"}, nulls={"cost_usd": _unpriced("calls")})
            + _cost_breakdown(runs, con))


def _unpriced(calls: str) -> Callable[[dict[str, Any]], str]:
    """A null cost says "unpriced" where the row has LLM calls (unknown, not $0), else "—"."""
    return lambda row: "—" if row.get(calls) is None else "unpriced"


def _cost_breakdown(runs: list[Run], con: DuckDBPyConnection) -> str:
    """Cost by category and billed vs a naive client, all steps: the tables of `draco audit
    cost`, from the call logs' totals per phase and status (``cost_categories``) and summed
    inside SQLite (``billed_vs_naive_logs``): no row per call reaches memory."""
    from draco_cli.audit import billed_vs_naive_logs, cost_categories
    from draco_cli.run.folder import RunFolder
    from draco_cli.sql import CALL_LOG

    views = _views(con)   # call_totals among them: _cost, the one caller, checked
    logs = [log for r in runs for log in [RunFolder.open(r.dir).call_log
                                          if RunFolder.is_run_folder(r.dir)
                                          else r.dir / CALL_LOG] if Path(log).exists()]
    have = set(_frame(con, "DESCRIBE call_totals")["column_name"].to_list())
    totals = _frame(con, "SELECT phase, status, " + ", ".join(
        f"sum({c})::{'DOUBLE' if c == 'cost_usd' else 'BIGINT'} AS {c}"
        for c in ("n_rows", "input_tokens", "output_tokens", "reasoning_tokens", "cost_usd")
        if c in have) + " FROM call_totals GROUP BY 1, 2 ORDER BY 1, 2")
    rollouts = _frame(con, "SELECT response_len FROM rollouts") \
        if "rollouts" in views and "response_len" in _frame(
            con, "DESCRIBE rollouts")["column_name"].to_list() else None
    steps = _frame(con, "SELECT n_tokens FROM steps") if "steps" in views and "n_tokens" in \
        _frame(con, "DESCRIBE steps")["column_name"].to_list() else None
    by_cat = cost_categories(totals, rollouts, steps)
    naive = billed_vs_naive_logs(logs)
    out = ("<h3 id='cost-category'>Cost by category</h3><p class='note'>Original = the "
           "rollouts' own response tokens and environment actions; the LLM rows are draco's "
           "calls by what they were for.</p>"
           + _table(by_cat, {"cost_usd": ".4f"}, nulls={"cost_usd": _unpriced("llm_calls")}))
    if naive.height:
        every = {r["route"]: r["billed_over_naive"]
                 for r in naive.filter(pl.col("phase") == "all").iter_rows(named=True)}
        ratio = every.get("all")
        apart = "; ".join(f"{route} {every[route]:.3f}×" for route in ("online", "batch")
                          if every.get(route) is not None)
        out += ("<h3 id='cost-naive'>Billed vs a naive client</h3><p class='note'>A naive "
                "client makes one call per sample, with no prompt caching and no batch "
                "discount, paying every prompt token at the full input price"
                + (f"; draco paid <b>{ratio:.3f}×</b> of that" + (
                    f" ({apart}: calls through a batch API pay half price)"
                    if len(every) > 2 else "") + "." if ratio is not None else
                   " (unpriced model: tokens only).") + "</p>"
                + _table(naive, {"billed_usd": ".4f", "naive_usd": ".4f",
                                 "billed_over_naive": ".3f", "batch_share": ".2f"},
                         cls="naive"))
    return out


def _step_labels(runs: list[Run], con: DuckDBPyConnection) -> str:
    """The step-label audit's table (``draco audit step-labels`` wrote it under RUN/audit)."""
    if "step_label_audit" not in _views(con):
        return ("<p>No step-label audit in this run folder (<code>draco audit step-labels "
                "--run RUN</code> writes one).</p>")
    run = _q(str(runs[-1].dir))
    t = _frame(con, "SELECT source, figure, value, ci_low, ci_high, uniform, lift, n "
                    f"FROM step_label_audit WHERE run = {run}")
    if t.height == 0:
        return "<p>No step-label audit for the latest run.</p>"
    note = ("<p class='note'>Against the human step labels (SPEC §4): <b>auroc_quality</b> "
            "separates +1 from −1 steps by step quality; <b>bad_mass</b> / <b>good_mass</b>: "
            "the share of a losing (winning) rollout's push on −1 (+1) steps, beside the token "
            "share under uniform credit; <b>worst_step_hit</b>: the lowest-quality steps are "
            "−1. Intervals: 95% bootstrap over groups.</p>")
    return note + _table(t)
