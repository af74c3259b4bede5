"""draco report: one self-contained HTML file whose charts draw, and whose rollout picker
works, in headless Chromium; the figures it shows checked against the tables."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess

import polars as pl
import pytest

from tests.conftest import REPO, run_draco, sample_step

SAMPLE = ["--rollouts", "sample_data/appworld_mini/rollouts.parquet", "--steps",
          "sample_data/appworld_mini/steps.parquet", "--model",
          "replay/sample_data/llm_calls.sqlite"]
SECRET = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789ABCD"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    for n in (0, 1):
        inputs = sample_step(n, d.with_name(d.name + "-in"))
        assert run_draco("run", *inputs, *SAMPLE[4:], "--train-step", str(n), "-o",
                         str(d)).returncode == 0
    return d


@pytest.fixture(scope="module")
def report(runs):
    res = run_draco("report", str(runs / "step-0"), str(runs / "step-1"), "-o",
                    str(runs / "r.html"))
    assert res.returncode == 0, res.stderr.decode()
    return runs / "r.html"


def test_report_is_self_contained(report):
    text = report.read_text()
    # plotly.js is inlined: no script is loaded from anywhere
    assert not re.findall(r"<script[^>]{0,80}src=[^>]{0,80}>", text)
    assert "plotly.js v" in text or "Plotly" in text
    for section in ("Training steps at a glance", "Rewards and advantages", "Step credit",
                    "Criteria: pass rates, kept and dropped", "Over training steps",
                    "Answered requests", "Cost per training step"):
        assert section in text
    assert text.count("Plotly.newPlot") >= 6
    assert "Health check failed" not in text and "class='notice'" not in text  # all answered


def test_credit_heatmap_picker_and_step_table(report, runs):
    text = report.read_text()
    rewards = pl.read_parquet(runs / "step-1" / "credit" / "rewards.parquet")
    # one picker option and one panel per rollout, the largest |A_i| first
    options = re.findall(r"<option value='(\d+)'>([^<]+)</option>", text)
    assert len(options) == rewards.height == len(re.findall(r"class='rollout'", text))
    top = rewards.sort(pl.col("advantage").abs(), descending=True)["rollout_id"][0]
    assert options[0][1].startswith(top + " — ")
    # the heatmap holds step totals (not per-token values), one row per rollout
    sc = pl.read_parquet(runs / "step-1" / "credit" / "step_credit.parquet")
    heat = re.search(r'Plotly.newPlot\(\s*"heatmap",\s*(\[.*?\]),\s*\{', text, flags=re.S)
    data = json.loads(heat.group(1))[0]
    assert data["type"] == "heatmap" and len(data["y"]) == rewards.height
    row = data["y"].index(top)
    want = sc.filter(pl.col("rollout_id") == top).sort("step")["total"].to_list()
    assert [v for v in data["z"][row] if v is not None] == pytest.approx(want)
    assert data["x"] == list(range(1, int(sc["step"].max()) + 1))  # whole-number steps
    # each step row: cell coloured by its step total; equal totals get equal colours
    panel = text.split("id='rollout-0'")[1].split("</table>")[0]
    cells = re.findall(r"background:(rgba\([^)]*\))'>([+-][0-9.]+)<", panel)
    by_total: dict = {}
    for colour, total in cells:
        by_total.setdefault(total, set()).add(colour)
    assert all(len(c) == 1 for c in by_total.values())
    # judge reasons sit beside the steps they cite
    v = pl.read_parquet(runs / "step-1" / "judge" / "verdicts.parquet").filter(
        (pl.col("rollout_id") == top) & pl.col("verdict").is_in(["pass", "fail"])
        & (pl.col("cited_steps").list.len() > 0))
    assert v.height and all(r in panel for r in v["reason"].to_list())


def test_criteria_pass_rates_and_agreement_with_outcome(report, runs):
    text = report.read_text()
    assert "<th>filter (kept / dropped)</th>" in text and "<th></th>" not in text
    v = pl.read_parquet(runs / "step-1" / "judge" / "verdicts.parquet")
    per = v.group_by("criterion_id").agg(
        ((pl.col("verdict") == "pass").sum() / pl.col("verdict").is_in(["pass", "fail"]).sum())
        .alias("rate"))
    for rate in per["rate"].to_list():
        assert f"{rate:.0%}" in text
    # agreement: within-group pairs with different outcomes ordered the same way by reward
    rw = pl.read_parquet(runs / "step-1" / "credit" / "rewards.parquet").join(
        pl.read_parquet(REPO / SAMPLE[1]).select("rollout_id", "outcome"), on="rollout_id")
    agree = pairs = 0.0
    for _, g in rw.group_by("group_id"):
        rows = g.rows(named=True)
        for i, a in enumerate(rows):
            for b in rows[i + 1:]:
                if a["outcome"] == b["outcome"]:
                    continue
                pairs += 1
                d = (a["reward"] - b["reward"]) * (a["outcome"] - b["outcome"])
                agree += 0.5 if a["reward"] == b["reward"] else float(d > 0)
    row = re.search(r"<tr><td>step 1</td>(.*?)</tr>", text).group(1)
    cells = re.findall(r"<td class='num'>([^<]*)</td>", row)
    assert f"{agree / pairs:.3f}" == cells[3] and str(int(pairs)) == cells[4]


def test_criteria_left_out_by_rubric_dropout_are_not_shown_kept(tmp_path):
    # the credit stage leaves a seeded share of the retained criteria out of the reward: the
    # page must count them as the credit stage did, not as kept
    run = tmp_path / "run"
    res = run_draco("run", *SAMPLE, "--rubric-dropout", "0.5", "-o", str(run))
    assert res.returncode == 0, res.stderr.decode()
    stats = json.loads((run / "manifest.json").read_text())["stages"]["credit"]["stats"]
    out = stats["criteria_dropout"]
    assert out > 0
    assert (f"criteria kept {stats['criteria_kept']} ({out} of them left out by "
            "--rubric-dropout)") in res.stderr.decode()
    res = run_draco("report", str(run), "-o", str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr.decode()
    text = (tmp_path / "r.html").read_text()
    assert (f"<p>{stats['criteria_kept'] - out} criteria kept, {stats['criteria_dropped']} "
            "dropped by the discriminative filter") in text
    assert f", {out} left out of the reward by --rubric-dropout." in text
    assert text.count("<td>left out</td>") == out


def test_health_banner_redaction_and_minimal_call_log(runs, tmp_path):
    run = tmp_path / "step-0"
    shutil.copytree(runs / "step-0", run)
    m = json.loads((run / "manifest.json").read_text())
    m["health"] = {"ok": False, "threshold": 0.9, "messages": [
        "judge: answered 16 of 40 requests (40%), under --min-answered 90%: invalid ×24"],
        "stages": {
        "judge": {"requests": 40, "answered": 16, "answered_share": 0.4,
                  "reasons": {"invalid": 24}, "ok": False}}}
    steps = pl.read_parquet(REPO / SAMPLE[3])
    steps.with_columns(pl.col("action") + f" # {SECRET}").write_parquet(tmp_path / "steps.parquet")
    m["inputs"]["steps"]["path"] = str(tmp_path / "steps.parquet")
    m["inputs"]["rollouts"]["path"] = str(REPO / SAMPLE[1])
    (run / "manifest.json").write_text(json.dumps(m))
    # a call log holding only the columns the report reads
    calls = run / "llm_calls.sqlite"
    conn = sqlite3.connect(calls)
    conn.execute("CREATE TABLE slim AS SELECT phase, status, cost_usd, input_tokens, "
                  "output_tokens FROM calls")
    conn.execute("DROP TABLE calls")
    conn.execute("ALTER TABLE slim RENAME TO calls")
    conn.commit()
    conn.close()
    res = run_draco("report", str(run), "-o", str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr.decode()
    text = (tmp_path / "r.html").read_text()
    assert "Health check failed" in text and "answered 16 of 40 requests (40%)" in text
    # the same figure in the warning and the table as in the health message
    assert "judge answered 16 of 40 requests (40%) (invalid ×24)" in text
    assert "<td>judge</td><td>answered 16 of 40 requests (40%)</td>" in text
    assert SECRET not in text and "[REDACTED]" in text


def test_report_errors_are_one_line(runs, tmp_path):
    for args, words in (
            (["-o", str(tmp_path)], b"give an HTML file to write"),
            (["-o", str(tmp_path / "x.html"), "--rollout", "nope"],
             b"--rollout 'nope': no such rollout"),
    ):
        res = run_draco("report", str(runs / "step-0"), *args)
        assert res.returncode in (1, 2) and words in res.stderr, res.stderr.decode()
        assert len(res.stderr.decode().strip().splitlines()) == 1
    assert not (tmp_path / "x.html").exists()
    res = run_draco("report", str(tmp_path), "-o", str(tmp_path / "y.html"))
    assert res.returncode == 1 and b"not a draco run folder" in res.stderr


def _chromium(tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium missing in CI (.ci/run installs it)")
        pytest.skip("chromium not installed (Debian package 'chromium'; .ci/run installs it)")
    return chromium, ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                      "--no-first-run", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync",
                      f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
                      "--v=0", "--virtual-time-budget=8000"]


def test_charts_draw_and_picker_works_in_headless_chromium(report, tmp_path):
    chromium, flags = _chromium(tmp_path)
    # pick the third rollout as a user would (a change event on the select)
    page = tmp_path / "picked.html"
    page.write_text(report.read_text().replace(
        "</body>", "<script>var p = document.getElementById('pick'); p.value = '2';"
        "p.dispatchEvent(new Event('change'));</script></body>"))
    res = subprocess.run([chromium, *flags, "--dump-dom", f"file://{page}"],
                         capture_output=True, timeout=120)
    dom = res.stdout.decode()
    # plotly draws each chart as <svg class="main-svg">: present only if the scripts ran
    assert len(re.findall(r'class="main-svg"', dom)) >= 6, res.stderr.decode()[-2000:]
    console = res.stderr.decode()
    assert "Uncaught" not in console and "SyntaxError" not in console, console[-2000:]
    assert re.search(r'<div class="rollout" id="rollout-2">', dom)  # shown
    assert re.search(r'<div class="rollout" id="rollout-0" hidden="">', dom)  # hidden
    shot = tmp_path / "report.png"
    subprocess.run([chromium, *flags, "--window-size=1200,2400", f"--screenshot={shot}",
                    f"file://{report}"], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000
