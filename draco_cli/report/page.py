"""The whole report page, built from its sections."""

from __future__ import annotations

import html
from pathlib import Path

from draco_cli.report.data import _connect, _frame, _q, _runs, _verdicts, _views
from draco_cli.report.heatmap import _credit
from draco_cli.report.html import CSS, SCRIPT
from draco_cli.report.trend import health_banner, health_section, judge_health_of
from draco_cli.report.sections import (
    MAX_GROUP_STRIPS,
    _banner,
    _cost,
    _criteria,
    _distributions,
    _over_steps,
    _per_step,
    _step_labels,
    _unanswered,
)


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
    health, why_not = judge_health_of(runs)
    sections = [
        ("Training steps at a glance", summary_html),
        ("Rewards and advantages", _distributions(rw, n_groups)),
        (f"Step credit ({html.escape(last.label)})", credit),
        ("Criteria: pass rates, kept and dropped", _criteria(last, con, counts, redact)),
        ("Over training steps", _over_steps(runs, con, summary)),
        ("Judge health over training steps", health_section(health, why_not, redact)),
        ("Answered requests", unanswered_html),
        ("Cost per training step", _cost(runs, con)),
        ("Where credit lands (step labels)", _step_labels(runs, con)),
    ]
    con.close()
    body = "".join(f"<h2 id='{anchor}'>{t}</h2>{s}" for (t, s), anchor in zip(
        sections, ("steps", "rewards", "credit", "criteria", "trends", "judge-health", "unanswered", "cost",
                                 "step-labels")))
    settings = m.get("settings") or {}
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>draco report</title>"
            f"<style>{CSS}</style><script>{get_plotlyjs()}</script></head><body>"
            f"<h1>draco report</h1><p>{len(runs)} run(s); latest: "
            f"<code>{html.escape(str(last.dir))}</code> ({html.escape(last.label)}), setting "
            f"<code>{html.escape(str(settings.get('setting')))}</code>, model "
            f"<code>{html.escape(str(settings.get('model') or 'none'))}</code>, draco "
            f"{html.escape(str(m.get('draco_version', '')))}.</p>{_banner(runs, redact, unanswered)}"
            f"{health_banner(health, redact)}{body}"
            f"<script>{SCRIPT}</script></body></html>")
