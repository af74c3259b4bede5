"""``draco report``: one self-contained HTML file (plotly.js inlined, no network needed to
open it) over one or several run folders written by ``draco run``.

Cross-step figures (rewards against outcomes, unanswered shares, cost) are DuckDB queries over
the run folders' views (``draco_cli.sql``), the same views ``draco sql`` offers; each call log
is read as its totals per phase and status (SQLite sums it), never a row per call, so the
report's memory does not grow with the run (``benchmarks/bench_report.py``). Every text that came from a rollout or from an
LLM is redacted (default patterns) and escaped before it reaches the page.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import polars as pl

from draco_cli.errors import InputError

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection

# the redaction applied to every rollout or LLM text (a ``draco_cli.redact.Redactor``)
Redact = Callable[[str], str]

MAX_ROLLOUTS = 200  # rollouts offered in the picker and drawn in the heatmap
MAX_GROUP_STRIPS = 24  # above this many groups, histograms replace per-group strips
OBSERVATION_CHARS = 1500
MAX_CRITERIA_ROWS = 300  # criteria rows in the table; the rest are counted
HISTOGRAM_BINS = 30
GREEN, RED = (34, 139, 34), (200, 40, 40)


@dataclass
class Run:
    dir: Path
    manifest: dict[str, Any]   # JSON
    label: str  # "step N", or the folder when it has no train step
    step: int | None


def _manifest(run: Path) -> dict[str, Any]:
    from draco_cli.runfolder import RunFolder

    m = run / "manifest.json"
    if not run.is_dir() or not m.exists():
        raise InputError("not a draco run folder (no manifest.json)", file=str(run))
    if RunFolder.is_run_folder(run):  # typed, versioned; corrupt manifests named
        manifest = RunFolder.open(run).manifest
        assert manifest is not None  # open() raises when there is none
        return manifest.model_dump(mode="json")
    try:
        loaded: dict[str, Any] = json.loads(m.read_text())
        return loaded
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"not a readable manifest ({exc})", file=str(m)) from None


def _runs(run_dirs: list[Path]) -> list[Run]:
    from draco_cli.sql import expand_run_roots

    runs = []
    for d in expand_run_roots([Path(x) for x in run_dirs]):
        m = _manifest(Path(d))
        step = m.get("train_step")
        runs.append(Run(Path(d), m, f"step {step}" if step is not None else str(d), step))
    return runs


def _frame(con: DuckDBPyConnection, query: str) -> pl.DataFrame:
    # from_arrow turns a Table into a DataFrame (a Series only from an Array)
    return cast(pl.DataFrame, pl.from_arrow(con.sql(query).to_arrow_table()))


def _views(con: DuckDBPyConnection) -> set[str]:
    return {r[0] for r in con.sql("SELECT table_name FROM information_schema.tables")
            .fetchall()}


def _connect(runs: list[Run]) -> DuckDBPyConnection:
    """DuckDB views over every run folder; each call log as its totals per phase and status
    (``call_totals``): the report never holds a row per call."""
    from draco_cli.sql import catalog, connect

    con = connect(catalog([r.dir for r in runs], call_totals=True))
    # one thread: the report's queries take milliseconds, and each extra thread keeps buffers
    con.execute("SET threads = 1")
    return con


# --- small html helpers ------------------------------------------------------------------


def _esc(text: object, redact: Redact) -> str:
    return html.escape(redact(str(text))) if text is not None else ""


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "—" if v is None else format(v, fmt)


def _table(df: pl.DataFrame, formats: dict[str, str] | None = None, cls: str = "") -> str:
    formats = formats or {}
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    body = []
    for row in df.iter_rows(named=True):
        cells = []
        for c, v in row.items():
            if isinstance(v, float):
                cells.append(f"<td class='num'>{_num(v, formats.get(c, '.3f'))}</td>")
            elif isinstance(v, int):
                cells.append(f"<td class='num'>{v}</td>")
            else:
                cells.append(f"<td>{html.escape('—' if v is None else str(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table class='{cls}'><tr>{head}</tr>{''.join(body)}</table>"


def _fig_html(fig: Any, div_id: str | None = None, height: int = 360, top: int = 50) -> str:
    fig.update_layout(margin=dict(l=50, r=20, t=top, b=40), height=height,
                      template="plotly_white")
    html_text: str = fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                                 config={"displaylogo": False, "responsive": True})
    return html_text


def _rgba(value: float | None, scale: float) -> str:
    if value is None or not scale:
        return "transparent"
    x = max(-1.0, min(1.0, value / scale))
    r, g, b = GREEN if x >= 0 else RED
    return f"rgba({r},{g},{b},{0.08 + 0.62 * abs(x):.2f})"


def _int_axis(fig: Any, xs: list[int], title: str = "train step") -> None:
    fig.update_xaxes(title=title, tickmode="array", tickvals=xs,
                     ticktext=[str(x) for x in xs])


# --- sections -----------------------------------------------------------------------------


def _banner(runs: list[Run], redact: Redact, unanswered: list[str]) -> str:
    notice = "" if not unanswered else (
        "<div class='notice'><b>Unanswered calls</b> — these count as neither pass nor fail; "
        "see <a href='#unanswered'>Unanswered calls</a>.<ul>"
        + "".join(f"<li>{html.escape(w)}</li>" for w in unanswered) + "</ul></div>")
    items = []
    for r in runs:
        health = r.manifest.get("health")
        if not isinstance(health, dict) or health.get("ok", True):
            continue
        msgs = health.get("messages") or ["the health check failed"]
        items += [f"<li><b>{html.escape(r.label)}</b>: {_esc(m, redact)}</li>" for m in msgs]
    if not items:
        return notice
    return notice + ("<div class='banner'><b>Health check failed</b> — the judge or rubric writer left "
            "too many calls unanswered; rewards and credit below rest on what was answered."
            f"<ul>{''.join(items)}</ul></div>")


def _per_step(con: DuckDBPyConnection, runs: list[Run]) -> tuple[pl.DataFrame, str]:
    """One row per run: rollouts, rewards, outcome, the rubric reward's agreement with the
    environment outcome, unanswered verdicts, calls and dollars."""
    views = _views(con)
    rows = {str(r.dir): {"run": r.label} for r in runs}
    key = {str(r.dir): str(r.dir) for r in runs}
    if {"rewards", "rollouts"} <= views:
        frames = []
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
        for frame in frames:
            for row in frame.iter_rows(named=True):
                rows[key.get(row["run"], row["run"])].update(
                    {k: v for k, v in row.items() if k != "run"})
    if "verdicts" in views:
        for row in _frame(con, "SELECT run, avg((verdict IS NULL)::INT) AS unanswered_verdicts "
                               "FROM verdicts GROUP BY 1").iter_rows(named=True):
            rows[key.get(row["run"], row["run"])].update(
                {k: v for k, v in row.items() if k != "run"})
    if "call_totals" in views and "cost_usd" in _frame(con, "DESCRIBE call_totals")["column_name"]:
        for row in _frame(con, "SELECT run, sum(n_rows)::BIGINT AS calls, sum(cost_usd) "
                               "AS cost_usd FROM call_totals GROUP BY 1").iter_rows(named=True):
            rows[key.get(row["run"], row["run"])].update(
                {k: v for k, v in row.items() if k != "run"})
    cols = ["run", "rollouts", "mean_reward", "mean_outcome", "agreement", "pairs",
            "correlation", "unanswered_verdicts", "calls", "cost_usd"]
    df = pl.DataFrame([{c: r.get(c) for c in cols} for r in rows.values()],
                      schema={"run": pl.String, "rollouts": pl.Int64, "mean_reward": pl.Float64,
                              "mean_outcome": pl.Float64, "agreement": pl.Float64,
                              "pairs": pl.Int64, "correlation": pl.Float64,
                              "unanswered_verdicts": pl.Float64, "calls": pl.Int64,
                              "cost_usd": pl.Float64})
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


def _pick_rollouts(rw: pl.DataFrame, wanted: str | None) -> list[str]:
    order = rw.sort(pl.col("advantage").abs(), descending=True, nulls_last=True)
    ids = order["rollout_id"].head(MAX_ROLLOUTS).to_list()
    if wanted is not None and wanted not in ids:
        ids = [wanted] + ids[:MAX_ROLLOUTS - 1]
    elif wanted is not None:
        ids.remove(wanted)
        ids.insert(0, wanted)
    return ids


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
    ids = _pick_rollouts(rw, wanted)
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
            f"{html.escape(str(r['credit_mode']))}; {r['n_pass']} criteria passed, "
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


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _q_list(items: list[str]) -> str:
    return ", ".join(_q(x) for x in items) or "NULL"


CRITERIA = "__criteria_counts"  # DuckDB temp table: the run's verdicts per group, criterion


def _verdicts(run: Run, con: DuckDBPyConnection) -> str | None:
    """The run's verdicts counted per group and criterion, with ``retained`` (recomputed as the
    discriminative filter does, with the run's --drop, when the stored table leaves it empty),
    kept in DuckDB as temp table ``CRITERIA`` (a large run has tens of thousands of rows: the
    page fetches counts, the first rows and the shown rollouts' groups). None: no verdicts."""
    views = _views(con)
    if not {"verdicts", "rollouts"} <= views:
        return None
    one = _q(str(run.dir))
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {CRITERIA} AS
        SELECT ro.group_id, v.criterion_id,
               count(*) FILTER (WHERE v.verdict = 'pass') AS pass,
               count(*) FILTER (WHERE v.verdict = 'fail') AS fail,
               count(*) FILTER (WHERE v.verdict = 'na') AS na,
               count(*) FILTER (WHERE v.verdict IS NULL) AS unanswered,
               bool_or(v.retained) AS retained, count(v.retained) AS stored
        FROM (SELECT rollout_id, criterion_id, verdict, retained FROM verdicts
              WHERE run = {one}) v
        JOIN (SELECT rollout_id, group_id FROM rollouts WHERE run = {one}) ro
        USING (rollout_id) GROUP BY 1, 2""")
    n, stored = _frame(con, f"SELECT count(*) AS n, sum(stored) AS stored FROM {CRITERIA}").row(0)
    if n and not stored:
        drop = (run.manifest.get("settings") or {}).get("drop") or "all-pass"
        keep = "fail > 0" + (" AND pass + na > 0" if drop == "constant" else "")
        con.execute(f"UPDATE {CRITERIA} SET retained = {keep}")
    con.execute(f"UPDATE {CRITERIA} SET retained = false WHERE retained IS NULL")
    return CRITERIA


def _titles(run: Run, con: DuckDBPyConnection, pairs: pl.DataFrame) -> pl.DataFrame:
    """``pairs`` (group_id, criterion_id) with the criterion's title (its id without one)."""
    title = pl.col("criterion_id")
    if "rubrics" in _views(con) and pairs.height:
        rb = _frame(con, f"""SELECT group_id, criterion_id, first(title) AS title FROM rubrics
                             WHERE run = {_q(str(run.dir))} AND group_id IN
                             ({_q_list(pairs["group_id"].unique().to_list())}) GROUP BY 1, 2""")
        pairs = pairs.join(rb, on=["group_id", "criterion_id"], how="left",
                           maintain_order="left")
        title = pl.coalesce("title", "criterion_id")
    return pairs.with_columns(title.alias("title"))


def _verdict_details(run: Run, con: DuckDBPyConnection, counts: str,
                     ids: list[str]) -> pl.DataFrame:
    """The verdicts of rollouts ``ids`` (a few hundred) with reasons, citations, titles and
    their criterion's ``retained`` from table ``counts`` (``_verdicts``)."""
    v = _frame(con, f"""
        SELECT v.rollout_id, ro.group_id, v.criterion_id, v.verdict, v.cited_steps, v.reason
        FROM verdicts v JOIN rollouts ro ON ro.rollout_id = v.rollout_id AND ro.run = v.run
        WHERE v.run = {_q(str(run.dir))} AND v.rollout_id IN ({_q_list(ids)})""")
    per = _frame(con, f"SELECT group_id, criterion_id, retained FROM {counts} WHERE group_id "
                      f"IN ({_q_list(v['group_id'].drop_nulls().unique().to_list())})")
    v = v.join(per, on=["group_id", "criterion_id"], how="left", maintain_order="left")
    return _titles(run, con, v)


def _criteria(run: Run, con: DuckDBPyConnection, counts: str | None, redact: Redact) -> str:
    if counts is None:
        return "<p>No verdicts in this run.</p>"
    total, kept = _frame(con, "SELECT count(*) AS n, count(*) FILTER (WHERE retained) AS kept "
                              f"FROM {counts}").row(0)
    if total == 0:
        return "<p>No verdicts in this run.</p>"
    # A large run has a row per group and criterion (tens of thousands): the page shows the
    # first MAX_CRITERIA_ROWS in group order and counts the rest.
    head = _frame(con, f"SELECT * EXCLUDE (stored) FROM {counts} ORDER BY group_id NULLS "
                       f"FIRST, criterion_id NULLS FIRST LIMIT {MAX_CRITERIA_ROWS}")
    per = head.with_columns(
        pl.when(pl.col("retained")).then(pl.lit("kept")).otherwise(pl.lit("dropped"))
        .alias("filter"),
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
            f"<tr class='{r['filter']}'><td>{html.escape(str(r['group']))}</td>"
            f"<td>{html.escape(r['criterion'])}</td><td>{r['filter']}</td>"
            f"<td class='num'>{'—' if rate is None else f'{rate:.0%}'} {bar}</td>"
            f"<td class='num'>{r['pass']}</td><td class='num'>{r['fail']}</td>"
            f"<td class='num'>{r['na']}</td><td class='num'>{r['unanswered']}</td></tr>")
    rest = total - shown.height
    more = (f"<p class='note'>The first {shown.height} of {total} criteria (by group) are "
            f"shown; {rest} more, of which {kept - int((shown['filter'] == 'kept').sum())} kept. "
            "All of them: <code>draco sql RUN \"SELECT * FROM verdicts\"</code>.</p>"
            if rest else "")
    return (f"<p>{kept} criteria kept, {total - kept} dropped by the discriminative filter "
            "(no member of the group failed them, so they cannot tell members apart). Pass rate "
            "= passes / (passes + fails) over the group's rollouts.</p>"
            f"<details{' open' if total <= 60 else ''}><summary>{total} criteria"
            "</summary><table><tr><th>group</th>"
            "<th>criterion</th><th>filter (kept / dropped)</th><th>pass rate</th><th>pass</th>"
            "<th>fail</th><th>na</th><th>unanswered</th></tr>" + "".join(rows)
            + "</table>" + more + "</details>")


def _unanswered(runs: list[Run], con: DuckDBPyConnection) -> tuple[str, list[str]]:
    """Answered shares per stage (from the run's health record, else from its call log), and a
    warning line for each stage that left calls unanswered."""
    rows = []
    from_health = set()
    for r in runs:
        health = r.manifest.get("health")
        stages = health.get("stages") if isinstance(health, dict) else None
        if isinstance(stages, dict) and stages:
            for stage, s in stages.items():
                if not isinstance(s, dict):
                    continue
                calls, answered = s.get("calls"), s.get("answered")
                share = s.get("answered_share")
                reasons = ", ".join(f"{k} {v}" for k, v in (s.get("reasons") or {}).items())
                from_health.add(str(r.dir))
                rows.append({"run": r.label, "stage": stage, "calls": calls,
                             "answered": answered,
                             "unanswered_share": None if share is None else 1 - share,
                             "reasons": reasons or "—"})
    if "call_totals" in _views(con):
        labels = {str(r.dir): r.label for r in runs}
        got = _frame(con, """SELECT run, phase, sum(n_rows)::BIGINT AS calls,
                                    sum(CASE WHEN status = 'ok' THEN n_rows ELSE 0 END)::BIGINT
                                        AS answered,
                                    string_agg(CASE WHEN status <> 'ok' THEN status END, ', '
                                               ORDER BY status) AS reasons
                             FROM call_totals GROUP BY 1, 2 ORDER BY 1, 2""")
        for x in got.filter(~pl.col("run").is_in(list(from_health))).iter_rows(named=True):
            rows.append({"run": labels.get(x["run"], x["run"]), "stage": x["phase"],
                         "calls": x["calls"], "answered": x["answered"],
                         "unanswered_share": 1 - x["answered"] / x["calls"] if x["calls"]
                         else None, "reasons": x["reasons"] or "—"})
    if not rows:
        return "<p>No LLM calls logged.</p>", []
    df = pl.DataFrame(rows, schema={"run": pl.String, "stage": pl.String, "calls": pl.Int64,
                                    "answered": pl.Int64, "unanswered_share": pl.Float64,
                                    "reasons": pl.String})
    warnings = [f"{r['run']}: {r['stage']} left {r['unanswered_share']:.1%} of "
                f"{r['calls']} calls unanswered ({r['reasons']})"
                for r in df.iter_rows(named=True) if (r["unanswered_share"] or 0) > 0]
    return ("<p>Calls per stage and the share left unanswered (an unanswered verdict counts "
            "as neither pass nor fail).</p>" + _table(df, {"unanswered_share": ".1%"}),
            warnings)


def _over_steps(runs: list[Run], con: DuckDBPyConnection, summary: pl.DataFrame) -> str:
    import plotly.graph_objects as go

    from draco_cli.evaluate import evaluate

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
                              coalesce(sum(cost_usd), 0) AS cost_usd
                       FROM call_totals GROUP BY 1, 2 ORDER BY 1, 2""")
    if c.height == 0:
        return "<p>No LLM calls logged.</p>"
    order = {str(r.dir): (r.step if r.step is not None else i) for i, r in enumerate(runs)}
    c = c.with_columns(pl.col("run").replace_strict(order, return_dtype=pl.Int64).alias("x"))
    xs = sorted(set(c["x"].to_list()))
    total = float(c["cost_usd"].sum())
    # replayed or self-hosted calls cost nothing: then the calls themselves are the cost
    y, unit = ("cost_usd", "USD") if total > 0 else ("calls", "calls")
    fig = go.Figure()
    for phase in sorted(set(c["phase"].to_list())):
        p = c.filter(pl.col("phase") == phase)
        fig.add_trace(go.Bar(x=p["x"].to_list(), y=p[y].to_list(), name=phase,
                             customdata=p[["calls", "cost_usd"]].rows(),
                             hovertemplate="%{x}: $%{customdata[1]:.4f}, %{customdata[0]} "
                             "calls"))
    title = (f"Dollars per training step, by phase (total ${total:.4f})" if total > 0 else
             "Calls per training step, by phase (no dollars logged: replayed or free calls)")
    fig.update_layout(barmode="stack", title=title, yaxis_title=unit, yaxis_rangemode="tozero")
    _int_axis(fig, xs)
    table = c.group_by("phase").agg(pl.col("calls").sum(), pl.col("cost_usd").sum()).sort(
        "phase")
    return (_fig_html(fig) + "<p>Calls and dollars per phase, all steps:</p>"
            + _table(table, {"cost_usd": ".4f"}) + _cost_breakdown(runs, con))


def _cost_breakdown(runs: list[Run], con: DuckDBPyConnection) -> str:
    """Cost by category and billed vs a naive client, all steps: the tables of `draco audit
    cost`, from the call logs' totals per phase and status (``cost_categories``) and summed
    inside SQLite (``billed_vs_naive_logs``): no row per call reaches memory."""
    from draco_cli.audit import billed_vs_naive_logs, cost_categories
    from draco_cli.runfolder import RunFolder
    from draco_cli.sql import CALL_LOG

    views = _views(con)
    if "call_totals" not in views:
        return ""
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
           "calls by what they were for.</p>" + _table(by_cat, {"cost_usd": ".4f"}))
    if naive.height:
        total = naive.filter(pl.col("phase") == "all").to_dicts()[0]
        ratio = total["billed_over_naive"]
        out += ("<h3 id='cost-naive'>Billed vs a naive client</h3><p class='note'>A naive "
                "client makes one call per sample, with no prompt caching and no batch "
                "discount, paying every prompt token at the full input price"
                + (f"; draco paid <b>{ratio:.3f}×</b> of that." if ratio is not None else
                   " (unpriced model: tokens only).") + "</p>"
                + _table(naive, {"billed_usd": ".4f", "naive_usd": ".4f",
                                 "billed_over_naive": ".3f", "batch_share": ".2f"},
                         cls="naive"))
    return out


CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em} h2{margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.88em;width:100%;table-layout:auto}
td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
th{background:#f6f6f6} td.num{text-align:right;white-space:nowrap}
pre{margin:0;white-space:pre-wrap;overflow-wrap:anywhere;font-size:.95em;max-height:24em;
    overflow:auto} pre.obs{color:#555;background:#fafafa}
table.steps td:nth-child(2){width:45%} table.steps td.judge{width:35%;font-size:.92em}
tr.dropped{color:#999} .dim{color:#999} .note{color:#555;font-size:.9em}
div.pass{color:#1b6e1b} div.fail{color:#a32020} details summary{cursor:pointer;color:#555}
.banner{background:#fdecea;border:1px solid #e0a3a0;padding:.8em 1em;border-radius:4px;
        margin:1em 0} .notice{background:#fff8e1;border:1px solid #e6c65c;padding:.8em 1em;
        border-radius:4px;margin:1em 0} .notice ul,.banner ul{margin:.4em 0 0 1em;padding:0}
.bar{display:inline-block;width:60px;height:.7em;background:#eee;vertical-align:middle}
.bar span{display:block;height:100%;background:#5a9bd5}
select{font-size:.95em;max-width:100%}
"""

SCRIPT = """
(function(){
  var pick = document.getElementById('pick');
  if (!pick) return;
  function show(i){
    document.querySelectorAll('div.rollout').forEach(function(d){ d.hidden = true; });
    var d = document.getElementById('rollout-' + i); if (d) d.hidden = false;
    pick.value = String(i);
  }
  pick.addEventListener('change', function(){ show(pick.value); });
  var heat = document.getElementById('heatmap');
  if (heat && heat.on) heat.on('plotly_click', function(ev){
    var id = ev.points[0].y;
    for (var i = 0; i < pick.options.length; i++)
      if (pick.options[i].text.indexOf(id + ' — ') === 0) { show(i);
        document.getElementById('rollout-' + i).scrollIntoView({behavior: 'smooth'}); break; }
  });
})();
"""


def build_report(run_dirs: list[Path], rollout_id: str | None = None) -> str:
    from plotly.offline import get_plotlyjs

    from draco_cli.redact import Redactor

    redact = Redactor()
    runs = _runs(run_dirs)
    con = _connect(runs)
    last = runs[-1]
    m = last.manifest
    rw, n_groups = None, 0
    if "rewards" in _views(con):
        runq = _q(str(last.dir))
        # counted as polars' n_unique counts: a missing group id is a group of its own
        n_groups = _frame(con, "SELECT count(DISTINCT group_id) + (count(*) > count(group_id))"
                               f"::INT AS g FROM rewards WHERE run = {runq}")["g"][0]
        # with many groups the page shows histograms: the two numbers per rollout suffice
        rw = _frame(con, "SELECT " + ("" if n_groups > MAX_GROUP_STRIPS else
                                      "rollout_id, group_id, ") + "reward, advantage "
                         f"FROM rewards WHERE run = {runq}")
    summary, summary_html = _per_step(con, runs)
    unanswered_html, unanswered = _unanswered(runs, con)
    counts = _verdicts(last, con)
    credit = _credit(last, con, counts, rollout_id, redact)
    sections = [
        ("Training steps at a glance", summary_html),
        ("Rewards and advantages", _distributions(rw, n_groups)),
        (f"Step credit ({html.escape(last.label)})", credit),
        ("Criteria: pass rates, kept and dropped", _criteria(last, con, counts, redact)),
        ("Over training steps", _over_steps(runs, con, summary)),
        ("Unanswered calls", unanswered_html),
        ("Cost per training step", _cost(runs, con)),
    ]
    con.close()
    body = "".join(f"<h2 id='{anchor}'>{t}</h2>{s}" for (t, s), anchor in zip(
        sections, ("steps", "rewards", "credit", "criteria", "trends", "unanswered", "cost")))
    settings = m.get("settings") or {}
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>draco report</title>"
            f"<style>{CSS}</style><script>{get_plotlyjs()}</script></head><body>"
            f"<h1>draco report</h1><p>{len(runs)} run(s); latest: "
            f"<code>{html.escape(str(last.dir))}</code> ({html.escape(last.label)}), setting "
            f"<code>{html.escape(str(settings.get('setting')))}</code>, model "
            f"<code>{html.escape(str(settings.get('model')))}</code>, draco "
            f"{html.escape(str(m.get('draco_version', '')))}.</p>{_banner(runs, redact, unanswered)}{body}"
            f"<script>{SCRIPT}</script></body></html>")
