"""draco report: one self-contained HTML file whose charts draw in headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import run_draco

SAMPLE = ["--rollouts", "sample_data/appworld_mini/rollouts.parquet", "--steps",
          "sample_data/appworld_mini/steps.parquet", "--model",
          "replay/sample_data/llm_calls.sqlite"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    for n in (0, 1):
        assert run_draco("run", *SAMPLE, "--train-step", str(n), "-o", str(d)).returncode == 0
    res = run_draco("report", str(d / "step-0"), str(d / "step-1"), "-o", str(d / "r.html"))
    assert res.returncode == 0, res.stderr.decode()
    return d / "r.html"


def test_report_is_self_contained(report):
    text = report.read_text()
    # plotly.js is inlined: no script is loaded from anywhere
    assert not re.findall(r"<script[^>]{0,80}src=[^>]{0,80}>", text)
    assert "plotly.js v" in text or "Plotly" in text
    for section in ("Rewards and advantages", "One rollout, step by step",
                    "Criteria kept and dropped", "Over training steps", "LLM calls and dollars"):
        assert section in text
    assert "amazon-march-1" in text or "spotify-follow" in text
    assert text.count("Plotly.newPlot") >= 4


def test_charts_draw_in_headless_chromium(report, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium missing in CI (.ci/run installs it)")
        pytest.skip("chromium not installed (Debian package 'chromium'; .ci/run installs it)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=5000"]
    res = subprocess.run([chromium, *flags, "--dump-dom", f"file://{report}"],
                         capture_output=True, timeout=120)
    dom = res.stdout.decode()
    # plotly draws each chart as <svg class="main-svg">: present only if the scripts ran
    assert len(re.findall(r'class="main-svg"', dom)) >= 4, res.stderr.decode()[-2000:]
    console = res.stderr.decode()
    assert "Uncaught" not in console and "SyntaxError" not in console, console[-2000:]
    shot = tmp_path / "report.png"
    subprocess.run([chromium, *flags, "--window-size=1200,2400", f"--screenshot={shot}",
                    f"file://{report}"], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000
