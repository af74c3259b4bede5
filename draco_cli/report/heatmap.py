"""The credit heatmap with its rollout picker and the judge's reasons beside each step."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, cast

import polars as pl

from draco_cli.errors import InputError

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection
from draco_cli.report.data import Redact, Run, _frame, _q, _q_list, _verdict_details, _views
from draco_cli.report.html import _esc, _fig_html, _int_axis, _num, _rgba

MAX_ROLLOUTS = 200  # rollouts offered in the picker and drawn in the heatmap


OBSERVATION_CHARS = 1500


def _credit(run: Run, con: DuckDBPyConnection, counts: str | None,
            wanted: str | None, redact: Redact) -> str:
    import plotly.graph_objects as go

    views = _views(con)
    if not {"rewards", "step_credit", "steps"} <= views:
        return "<p>No step credit in this run.</p>"
    runq = _q(str(run.dir))
    # the rollouts of largest |A_i| (and the one asked for), not the whole table
    rw = _frame(con, f"""
        SELECT * FROM rewards WHERE run = {runq} AND (rollout_id IN (
            SELECT rollout_id FROM rewards WHERE run = {runq}
            ORDER BY abs(advantage) DESC NULLS LAST LIMIT {MAX_ROLLOUTS})
            OR rollout_id = {_q(str(wanted))})""")
    n_rollouts = _frame(con, f"SELECT count(*) AS n FROM rewards WHERE run = {runq}")["n"][0]
    if wanted is not None and not (rw["rollout_id"] == wanted).any():
        sample = ", ".join(_frame(con, f"SELECT rollout_id FROM rewards WHERE run = {runq} "
                                       "LIMIT 3")["rollout_id"].to_list())
        raise InputError(f"--rollout {wanted!r}: no such rollout in this run (e.g. {sample})",
                         file=str(run.dir))
    # the query's rollouts by |A_i| (the one asked for first), at most MAX_ROLLOUTS
    by_push = rw.sort(pl.col("advantage").abs(), descending=True, nulls_last=True)
    ids = ([] if wanted is None else [wanted]) + [
        x for x in by_push["rollout_id"].to_list() if x != wanted]
    del ids[MAX_ROLLOUTS:]
    sel = _q_list(ids)
    sc = _frame(con, f"""
        SELECT sc.rollout_id, sc.step, sc.n_tokens, sc.advantage, sc.total, sc.p, sc.f,
               st.action, st.observation
        FROM step_credit sc LEFT JOIN (
             -- filtered before the join, so only the shown rollouts' step text is read
             SELECT run, rollout_id, step, action, observation FROM steps
             WHERE run = {runq} AND rollout_id IN ({sel})) st
             ON st.rollout_id = sc.rollout_id AND st.step = sc.step AND st.run = sc.run
        WHERE sc.run = {runq} AND sc.rollout_id IN ({sel}) ORDER BY sc.rollout_id, sc.step""")
    verdicts = None if counts is None else _verdict_details(run, con, counts, ids)
    info = {r["rollout_id"]: r for r in rw.filter(pl.col("rollout_id").is_in(ids))
            .iter_rows(named=True)}
    by_rollout = {k[0]: g for k, g in sc.group_by("rollout_id")} if sc.height else {}
    cites: dict[tuple[str, int], list[str]] = {}
    uncited: dict[str, list[str]] = {}
    if verdicts is not None:
        for v in verdicts.sort("title").iter_rows(named=True):
            if v["verdict"] not in ("pass", "fail"):
                continue
            mark = "✔" if v["verdict"] == "pass" else "✘"
            dropped = " <span class='dim'>(dropped criterion)</span>" if v["retained"] is False \
                else ""
            line = (f"<div class='{v['verdict']}'>{mark} <b>{_esc(v['title'], redact)}</b>"
                    f"{dropped}: {_esc(v['reason'], redact)}</div>")
            steps = v["cited_steps"] or []
            for s in steps:
                cites.setdefault((v["rollout_id"], s), []).append(line)
            if not steps:
                uncited.setdefault(v["rollout_id"], []).append(line)

    # heatmap: rollouts x steps, the step total n_j * a_j (what to compare across steps)
    max_step = int(cast(int, sc["step"].max())) if sc.height else 0  # a non-empty int column
    z: list[list[float | None]] = []
    hover: list[list[str]] = []
    labels: list[str] = []
    for rid in ids:
        g = by_rollout.get(rid)
        row: list[float | None] = [None] * max_step
        tips = [""] * max_step
        if g is not None:
            for s in g.iter_rows(named=True):
                row[s["step"] - 1] = s["total"]
                act = redact(s["action"] or "")[:90].replace("\n", " ")
                tips[s["step"] - 1] = html.escape(act)
        z.append(row)
        hover.append(tips)
        labels.append(rid)
    zmax = max((abs(x) for r in z for x in r if x is not None), default=1.0) or 1.0
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(1, max_step + 1)), y=labels, customdata=hover, zmid=0,
        zmin=-zmax, zmax=zmax, colorscale=[[0, "rgb(200,40,40)"], [0.5, "rgb(247,247,247)"],
                                           [1, "rgb(34,139,34)"]],
        colorbar=dict(title="step total"), xgap=1, ygap=1,
        hovertemplate="%{y} step %{x}<br>total %{z:+.3f}<br>%{customdata}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    _int_axis(fig, list(range(1, max_step + 1)), "step")
    fig.update_layout(title="Step totals n<sub>j</sub>·a<sub>j</sub> per rollout (click a row "
                      "to open it below)")
    capped = (f"<p class='note'>The {MAX_ROLLOUTS} rollouts with the largest |A<sub>i</sub>| "
              f"of {n_rollouts} are shown.</p>" if n_rollouts > len(ids) else "")
    heat = _fig_html(fig, "heatmap", height=min(140 + 22 * len(ids), 4600))

    options, panels = [], []
    for i, rid in enumerate(ids):
        r = info[rid]
        reward = _num(r["reward"])
        options.append(f"<option value='{i}'>{html.escape(rid)} — group "
                       f"{html.escape(str(r['group_id']))}, reward {reward}, A "
                       f"{_num(r['advantage'], '+.3f')}</option>")
        g = by_rollout.get(rid)
        rows = []
        if g is not None:
            scale = max((abs(x) for x in g["total"].to_list() if x is not None), default=0.0)
            for s in g.iter_rows(named=True):
                obs = redact(s["observation"] or "")
                more = len(obs) > OBSERVATION_CHARS
                obs_html = html.escape(obs[:OBSERVATION_CHARS]) + (
                    f"\n[… {len(obs) - OBSERVATION_CHARS} more characters]" if more else "")
                judged = "".join(cites.get((rid, s["step"]), [])) or "<i class='dim'>uncited" \
                    "</i>"
                rows.append(
                    f"<tr><td class='num'>{s['step']}</td>"
                    f"<td><pre>{_esc(s['action'], redact)}</pre>"
                    + (f"<details{' open' if len(obs) <= 300 else ''}><summary>observation"
                       f"</summary><pre class='obs'>{obs_html}</pre></details>" if obs else "")
                    + f"</td><td class='num' style='background:{_rgba(s['total'], scale)}'>"
                    f"{_num(s['total'], '+.3f')}</td><td class='num'>"
                    f"{_num(s['advantage'], '+.4f')}</td><td class='num'>{s['n_tokens']}</td>"
                    f"<td class='judge'>{judged}</td></tr>")
        extra = "".join(uncited.get(rid, []))
        panels.append(
            f"<div class='rollout' id='rollout-{i}'{'' if i == 0 else ' hidden'}>"
            f"<p>Rollout <b>{html.escape(rid)}</b> (group {html.escape(str(r['group_id']))}):"
            f" reward {reward}, A<sub>i</sub> = {_num(r['advantage'], '+.4f')}, credit "
            f"{html.escape(str(r['credit_mode']))}; criteria: {r['n_pass']} passed, "
            f"{r['n_fail']} failed, {r['n_na']} not applicable.</p>"
            "<table class='steps'><tr><th>step</th><th>action (and what the environment "
            "answered)</th><th>step total n<sub>j</sub>·a<sub>j</sub></th><th>a<sub>j</sub> "
            "per token</th><th>tokens</th><th>judge: criteria citing this step, with the "
            "reason</th></tr>" + "".join(rows) + "</table>"
            + (f"<p>Verdicts citing no step:</p>{extra}" if extra else "") + "</div>")
    picker = ("<p><label>Rollout: <select id='pick'>" + "".join(options) + "</select></label> "
              "<span class='note'>Green = reinforced, red = suppressed; the cell colour is "
              "the step total, comparable across the steps of a rollout.</span></p>")
    return capped + heat + picker + "".join(panels)
