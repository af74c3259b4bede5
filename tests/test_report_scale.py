"""draco report on large runs: criteria table capped with the rest counted, histograms binned
before the page, the call log read for the report's columns only."""

from __future__ import annotations

import json
import re

import polars as pl
import pytest

from draco_cli.report import build_report, data, sections
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
    monkeypatch.setattr(sections, "MAX_CRITERIA_ROWS", 3)
    page = build_report([run])
    section = page.split("id='criteria'")[1].split("<h2")[0]
    assert len(re.findall(r"<tr class='(kept|dropped)'>", section)) == 3
    assert f"The first 3 of {n_criteria} criteria (by group) are shown; {n_criteria - 3} more" \
        in section


def test_histograms_are_binned_counts_of_every_rollout(run, monkeypatch):
    monkeypatch.setattr(sections, "MAX_GROUP_STRIPS", 1)
    page = build_report([run])
    rewards = pl.read_parquet(run / "credit" / "rewards.parquet")
    figs = re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", page, flags=re.S)
    bars = [t for f in figs for t in json.loads(f) if t.get("type") == "bar"
            and t.get("name") in ("reward", "advantage")]
    assert {t["name"] for t in bars} == {"reward", "advantage"}
    for t in bars:
        assert sum(t["y"]) == rewards[t["name"]].drop_nulls().len()
        assert len(t["y"]) == sections.HISTOGRAM_BINS


def test_call_log_read_as_totals_per_phase_and_status(run):
    import sqlite3

    con = data._connect(data._runs([run]))
    assert "calls" not in data._views(con)  # never a row per call, nor any prompt text
    got = data._frame(con, "SELECT phase, status, n_rows FROM call_totals ORDER BY 1, 2")
    assert "request" not in got.columns and "response" not in got.columns
    log = sqlite3.connect(run / "llm_calls.sqlite")
    want = log.execute("SELECT phase, status, count(*) FROM calls GROUP BY 1, 2 ORDER BY 1, 2")
    assert got.rows() == want.fetchall()


def _mixed_log(path, seed=7):
    """Rows of every status, priced, unpriced and replay/ models, replies with n samples
    (rows sharing a response), nulls in token and cost columns."""
    import random
    import sqlite3

    from draco_cli.llm.calllog import COLUMNS

    rng = random.Random(seed)
    rows = []
    for i in range(300):
        status = rng.choice(["ok", "ok", "invalid", "truncated", "refused", "http_error",
                             "unanswered", None])
        provider, model = rng.choice([("openai", "openai/gpt-4.1"), ("openai", "openai/gpt-4.1-mini"),
                                      ("openai", "no-such-model"), ("replay", "x"), (None, None)])
        reply = None if status in ("http_error", "unanswered") else f"reply {i}"
        for s in range(rng.choice([1, 1, 2, 3])):
            r = {"phase": rng.choice(["score", "generate", "merge", "propose", "match"]),
                 "status": status, "provider": provider, "model": model, "sample": s,
                 "response": reply, "input_tokens": rng.choice([None, rng.randint(0, 9000)]),
                 "cached_tokens": rng.choice([None, rng.randint(0, 500)]),
                 "cache_write_tokens": rng.choice([None, 0, 40]),
                 "output_tokens": rng.choice([None, rng.randint(0, 900)]),
                 "reasoning_tokens": rng.choice([None, 12]),
                 "cost_usd": rng.choice([None, rng.random() / 50]),
                 "batch_id": rng.choice([None, None, "b1"])}
            rows.append(tuple(r.get(c) for c in COLUMNS))
    con = sqlite3.connect(path)
    con.executemany(f"INSERT INTO calls ({', '.join(COLUMNS)}) VALUES "
                    f"({', '.join('?' * len(COLUMNS))})", rows)
    con.commit()
    con.close()


def test_cost_tables_from_totals_equal_those_from_every_row(run, tmp_path):
    """The report's cost by category (from the call log's totals per phase and status) and
    billed vs naive (from the billed rows only) equal `draco audit cost`'s tables computed from
    every row of the log."""
    import shutil

    from polars.testing import assert_frame_equal

    from draco_cli.audit import (billed_vs_naive, billed_vs_naive_logs, cost_categories,
                                 read_cost_rows)
    from draco_cli.sql import read_call_totals

    log = tmp_path / "llm_calls.sqlite"
    shutil.copy(run / "llm_calls.sqlite", log)
    _mixed_log(log)
    every = read_cost_rows(log)
    totals = pl.from_arrow(read_call_totals(log))
    assert totals["n_rows"].sum() == every.height
    assert_frame_equal(cost_categories(totals), cost_categories(every), rel_tol=1e-12)
    want = billed_vs_naive(every)
    assert want.filter(pl.col("phase") == "all")["naive_usd"][0] > 0  # priced rows counted
    both = want.filter(pl.col("route") == "all")
    assert (both["naive_calls"] > both["calls"]).all()  # replies with several samples
    assert set(want["route"]) == {"online", "batch", "all"}   # the mixed log has both routes
    assert_frame_equal(billed_vs_naive_logs([log]), want, rel_tol=1e-12)


def test_report_figures_unchanged_by_reading_totals(run, tmp_path):
    """Calls, answered shares, reasons and dollars in the page match the call log's rows."""
    import shutil
    import sqlite3

    d = tmp_path / "run"
    shutil.copytree(run, d)
    _mixed_log(d / "llm_calls.sqlite")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["health"] = None  # the unanswered shares then come from the call log
    (d / "manifest.json").write_text(json.dumps(manifest))
    page = build_report([d])
    con = sqlite3.connect(d / "llm_calls.sqlite")
    n, usd = con.execute("SELECT count(*), sum(coalesce(cost_usd, 0)) FROM calls").fetchone()
    steps = page.split("id='steps'")[1].split("<h2")[0]
    assert f"<td class='num'>{n}</td><td class='num'>{usd:.4f}</td>" in steps
    unanswered = page.split("id='unanswered'")[1].split("<h2")[0]
    for phase, calls, ok, reasons in con.execute(
            "SELECT phase, count(*), sum(status = 'ok'), group_concat(DISTINCT CASE WHEN "
            "status <> 'ok' THEN status END) FROM calls WHERE phase = 'score' GROUP BY 1"):
        # no health record: the log's rows, named as rows (a re-asked request has several)
        assert f"<td>{phase}</td><td>answered {ok} of {calls} call-log rows " \
            f"({100 * ok // calls}%)</td>" in unanswered
        listed = unanswered.split(f"<td>{phase}</td>")[1].split("</tr>")[0]
        assert sorted(reasons.split(",")) == [x.strip() for x in listed.split("<td>")[-1]
                                              .removesuffix("</td>").split(",")]
