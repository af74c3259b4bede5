"""``draco report``: one self-contained HTML file (plotly.js inlined, no network needed to
open it) over one or several run folders written by ``draco run``."""

from __future__ import annotations

import html
import json
from pathlib import Path

import polars as pl

from draco_cli.errors import InputError
from draco_cli.redact import redact


def _load_run(run: Path) -> dict:
    m = run / "manifest.json"
    if not m.exists():
        raise InputError("not a draco run folder (no manifest.json)", file=str(run))
    manifest = json.loads(m.read_text())
    out = {"dir": run, "manifest": manifest}
    for key, rel in (("rewards", "credit/rewards.parquet"), ("step_credit", "credit/step_credit.parquet"),
                     ("verdicts", "judge/verdicts.parquet"), ("rubrics", "rubric/rubrics.parquet"),
                     ("agreement", "audit/agreement.parquet")):
        p = run / rel
        out[key] = pl.read_parquet(p) if p.exists() else None
    r = Path(manifest["inputs"]["rollouts"]["path"])
    s = Path(manifest["inputs"]["steps"]["path"])
    out["rollouts"] = pl.read_parquet(r) if r.exists() else None
    out["steps"] = pl.read_parquet(s) if s.exists() else None
    calls = run / "llm_calls.sqlite"
    if calls.exists():
        from draco_cli.audit import read_calls

        out["calls"] = read_calls(calls)
    else:
        out["calls"] = None
    return out


def _fig_html(fig) -> str:
    fig.update_layout(margin=dict(l=40, r=20, t=40, b=40), height=360, template="plotly_white")
    return fig.to_html(full_html=False, include_plotlyjs=False)


def _distributions(run: dict) -> str:
    import plotly.graph_objects as go

    rw = run["rewards"]
    if rw is None or rw.height == 0:
        return "<p>No rewards in this run.</p>"
    fig = go.Figure()
    fig.add_trace(go.Box(x=rw["group_id"].to_list(), y=rw["reward"].to_list(), name="reward",
                         boxpoints="all", jitter=0.3))
    fig.add_trace(go.Box(x=rw["group_id"].to_list(), y=rw["advantage"].to_list(),
                         name="advantage A_i", boxpoints="all", jitter=0.3))
    fig.update_layout(boxmode="group", title="Reward and advantage per group")
    return _fig_html(fig)


def _color(a: float, scale: float) -> str:
    x = max(-1.0, min(1.0, a / scale)) if scale else 0.0
    if x >= 0:
        return f"rgba(34,139,34,{0.15 + 0.6 * x:.2f})"
    return f"rgba(200,40,40,{0.15 + 0.6 * -x:.2f})"


def _rollout_view(run: dict, rollout_id: str | None) -> str:
    sc, rw, v, rb, steps = (run[k] for k in ("step_credit", "rewards", "verdicts", "rubrics",
                                             "steps"))
    if sc is None or rw is None or steps is None:
        return "<p>No step credit in this run.</p>"
    if rollout_id is None:
        pick = rw.filter(pl.col("credit_mode") == "step").sort(
            pl.col("advantage").abs(), descending=True)
        if pick.height == 0:
            return "<p>No rollout under step credit.</p>"
        rollout_id = pick["rollout_id"][0]
    info = rw.filter(pl.col("rollout_id") == rollout_id).row(0, named=True)
    mine = sc.filter(pl.col("rollout_id") == rollout_id).sort("step").join(
        steps.select("rollout_id", "step", "action"), on=["rollout_id", "step"], how="left")
    titles = dict(zip(rb["criterion_id"], rb["title"])) if rb is not None else {}
    cites: dict[int, list[str]] = {}
    if v is not None:
        for r in v.filter(pl.col("rollout_id") == rollout_id).iter_rows(named=True):
            if r.get("retained") is False or r["verdict"] not in ("pass", "fail"):
                continue
            for s in r["cited_steps"] or []:
                mark = "✔" if r["verdict"] == "pass" else "✘"
                cites.setdefault(s, []).append(f"{mark} {html.escape(titles.get(r['criterion_id'], r['criterion_id']))}")
    scale = max((abs(x) for x in mine["advantage"].to_list()), default=1.0) or 1.0
    rows = []
    for r in mine.iter_rows(named=True):
        action = html.escape(redact(r["action"] or "")[:400])  # secrets masked, as for a judge
        rows.append(
            f"<tr><td>{r['step']}</td><td style='background:{_color(r['advantage'], scale)}'>"
            f"<pre>{action}</pre></td><td>{r['advantage']:+.4f}</td><td>{r['total']:+.2f}</td>"
            f"<td>{'<br>'.join(cites.get(r['step'], [])) or '<i>uncited</i>'}</td></tr>")
    reward_text = "—" if info["reward"] is None else f"{info['reward']:.3f}"
    head = (f"<p>Rollout <b>{html.escape(rollout_id)}</b> (group {html.escape(info['group_id'])})"
            f": reward {reward_text}, "
            f"A<sub>i</sub> = {info['advantage']:+.4f}, credit {info['credit_mode']}. Green = "
            "reinforced, red = suppressed; the step total n<sub>j</sub>·a<sub>j</sub> is what "
            "to compare across steps.</p>")
    return head + ("<table class='steps'><tr><th>step</th><th>action</th><th>a<sub>j</sub> per "
                   "token</th><th>total</th><th>cited by</th></tr>" + "".join(rows) + "</table>")


def _criteria(run: dict) -> str:
    v, rb = run["verdicts"], run["rubrics"]
    if v is None or rb is None:
        return "<p>No verdicts in this run.</p>"
    from draco_cli.credit import discriminative_filter

    r = run["rollouts"]
    vv = v if "group_id" in v.columns else v.join(r.select("rollout_id", "group_id"),
                                                 on="rollout_id", how="left")
    if "retained" not in vv.columns or vv["retained"].null_count() == vv.height:
        vv = discriminative_filter(vv)
    per = vv.group_by("group_id", "criterion_id").agg(
        pl.col("retained").first(), (pl.col("verdict") == "fail").sum().alias("fails"),
        (pl.col("verdict") == "pass").sum().alias("passes"),
        (pl.col("verdict") == "na").sum().alias("na")).join(
        rb.select("group_id", "criterion_id", "title"), on=["group_id", "criterion_id"],
        how="left").sort("group_id", "retained", descending=[False, True])
    rows = "".join(
        f"<tr class='{'kept' if r['retained'] else 'dropped'}'><td>{html.escape(r['group_id'])}"
        f"</td><td>{html.escape(r['title'] or r['criterion_id'])}</td>"
        f"<td>{'kept' if r['retained'] else 'dropped'}</td><td>{r['fails']}</td>"
        f"<td>{r['passes']}</td><td>{r['na']}</td></tr>" for r in per.iter_rows(named=True))
    kept = int(per["retained"].sum())
    return (f"<p>{kept} criteria kept, {per.height - kept} dropped (nobody failed them).</p>"
            "<table><tr><th>group</th><th>criterion</th><th></th><th>fail</th><th>pass</th>"
            f"<th>na</th></tr>{rows}</table>")


def _over_steps(runs: list[dict]) -> str:
    import plotly.graph_objects as go

    from draco_cli.evaluate import evaluate

    parts = []
    xs, ph, term = [], {}, {}
    for i, run in enumerate(runs):
        r = run["rollouts"]
        if r is None:
            continue
        x = run["manifest"].get("train_step")
        xs.append(x if x is not None else i)
        res = evaluate(r, [1, 2, 3])
        for k, v in res.summary["pass_hat_k"].items():
            ph.setdefault(k, []).append(v)
        for mode in set(term) | set(res.summary["termination_shares"]):
            term.setdefault(mode, [0.0] * (len(xs) - 1)).append(
                res.summary["termination_shares"].get(mode, 0.0))
        for mode in term:
            while len(term[mode]) < len(xs):
                term[mode].append(0.0)
    if len(xs) > 1:
        fig = go.Figure([go.Scatter(x=xs, y=v, mode="lines+markers", name=f"pass^{k}")
                         for k, v in ph.items()])
        fig.update_layout(title="pass^k over training steps", xaxis_title="train step")
        parts.append(_fig_html(fig))
        fig = go.Figure([go.Bar(x=xs, y=v, name=m) for m, v in term.items()])
        fig.update_layout(barmode="stack", title="Termination modes over training steps",
                          xaxis_title="train step")
        parts.append(_fig_html(fig))
    agreement = [run["agreement"] for run in runs if run["agreement"] is not None]
    if agreement:
        a = pl.concat(agreement).filter(pl.col("scope").str.starts_with("step:")).with_columns(
            pl.col("scope").str.replace("step:", "").cast(pl.Int64).alias("step")).sort("step")
        if a.height:
            fig = go.Figure([go.Scatter(x=a["step"].to_list(), y=a[c].to_list(),
                                        mode="lines+markers", name=c)
                             for c in ("agreement", "false_pass_rate", "false_fail_rate")])
            fig.update_layout(title="Self-judge vs reference over training steps",
                              xaxis_title="train step")
            parts.append(_fig_html(fig))
    return "".join(parts) or "<p>Give several run folders (one per training step) to see " \
        "trends; an audit in RUN/audit/agreement.parquet adds judge agreement.</p>"


def _cost(runs: list[dict]) -> str:
    import plotly.graph_objects as go

    frames = [run["calls"] for run in runs if run["calls"] is not None and run["calls"].height]
    if not frames:
        return "<p>No LLM calls logged.</p>"
    c = pl.concat(frames, how="diagonal_relaxed").group_by("phase").agg(
        pl.col("cost_usd").fill_null(0).sum(), pl.len().alias("rows")).sort("phase")
    fig = go.Figure([go.Bar(x=c["phase"].to_list(), y=c["rows"].to_list(), name="calls",
                            text=[f"${x:.4f}" for x in c["cost_usd"].to_list()],
                            textposition="outside")])
    fig.update_layout(title=f"LLM calls and dollars per phase (total ${c['cost_usd'].sum():.4f})",
                      yaxis_title="logged calls")
    return _fig_html(fig)


CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em} h2{margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em;width:100%} td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top}
pre{margin:0;white-space:pre-wrap;font-size:.85em} tr.dropped{color:#999}
"""


def build_report(run_dirs: list[Path], rollout_id: str | None = None) -> str:
    from plotly.offline import get_plotlyjs

    runs = [_load_run(Path(d)) for d in run_dirs]
    last = runs[-1]
    m = last["manifest"]
    sections = [
        ("Rewards and advantages", _distributions(last)),
        ("One rollout, step by step", _rollout_view(last, rollout_id)),
        ("Criteria kept and dropped", _criteria(last)),
        ("Over training steps", _over_steps(runs)),
        ("Cost", _cost(runs)),
    ]
    body = "".join(f"<h2>{t}</h2>{s}" for t, s in sections)
    setting = html.escape(json.dumps(m.get("settings", {}).get("setting")))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>draco report</title>"
            f"<style>{CSS}</style><script>{get_plotlyjs()}</script></head><body>"
            f"<h1>draco report</h1><p>{len(runs)} run(s); latest: "
            f"<code>{html.escape(str(last['dir']))}</code>, setting {setting}, model "
            f"<code>{html.escape(str(m.get('settings', {}).get('model')))}</code>, draco "
            f"{html.escape(m.get('draco_version', ''))}.</p>{body}</body></html>")
