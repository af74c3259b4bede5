"""draco report on large runs: criteria table capped with the rest counted, histograms binned
before the page, the call log read for the report's columns only."""

from __future__ import annotations

import json
import re

import polars as pl
import pytest

import draco_cli.report as report
from tests.conftest import run_draco

SAMPLE = ["--rollouts", "sample_data/appworld_mini/rollouts.parquet", "--steps",
          "sample_data/appworld_mini/steps.parquet", "--model",
          "replay/sample_data/llm_calls.sqlite"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    assert run_draco("run", *SAMPLE, "--train-step", "0", "-o", str(d)).returncode == 0
    return d / "step-0"


def test_criteria_rows_capped_and_rest_counted(run, monkeypatch):
    n_criteria = pl.read_parquet(run / "rubric" / "rubrics.parquet").height
    monkeypatch.setattr(report, "MAX_CRITERIA_ROWS", 3)
    page = report.build_report([run])
    section = page.split("id='criteria'")[1].split("<h2")[0]
    assert len(re.findall(r"<tr class='(kept|dropped)'>", section)) == 3
    assert f"The first 3 of {n_criteria} criteria (by group) are shown; {n_criteria - 3} more" \
        in section


def test_histograms_are_binned_counts_of_every_rollout(run, monkeypatch):
    monkeypatch.setattr(report, "MAX_GROUP_STRIPS", 1)
    page = report.build_report([run])
    rewards = pl.read_parquet(run / "credit" / "rewards.parquet")
    figs = re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", page, flags=re.S)
    bars = [t for f in figs for t in json.loads(f) if t.get("type") == "bar"
            and t.get("name") in ("reward", "advantage")]
    assert {t["name"] for t in bars} == {"reward", "advantage"}
    for t in bars:
        assert sum(t["y"]) == rewards[t["name"]].drop_nulls().len()
        assert len(t["y"]) == report.HISTOGRAM_BINS


def test_call_log_read_as_totals_per_phase_and_status(run):
    import sqlite3

    con = report._connect(report._runs([run]))
    assert "calls" not in report._views(con)  # never a row per call, nor any prompt text
    got = report._frame(con, "SELECT phase, status, n_rows FROM call_totals ORDER BY 1, 2")
    assert "request" not in got.columns and "response" not in got.columns
    log = sqlite3.connect(run / "llm_calls.sqlite")
    want = log.execute("SELECT phase, status, count(*) FROM calls GROUP BY 1, 2 ORDER BY 1, 2")
    assert got.rows() == want.fetchall()
