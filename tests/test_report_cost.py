"""The report's cost section: cost by category and billed vs a naive client, the same
figures `draco audit cost` computes, shown in a page headless Chromium renders."""

from __future__ import annotations

import re
import subprocess

import polars as pl

from draco_cli.audit import billed_vs_naive, read_cost_rows
from draco_cli.llm import CallLog, LLMClient
from tests.conftest import run_draco
from tests.llm_server import FakeLLMServer
from tests.test_cost_naive import long_req
from tests.test_llm import PLANTED
from tests.test_report import SAMPLE, _chromium


def test_cost_by_category_and_billed_vs_naive(tmp_path, monkeypatch):
    run = tmp_path / "run"
    res = run_draco("run", *SAMPLE, "-o", str(run))
    assert res.returncode == 0, res.stderr.decode()
    # priced judge calls in the run's call log, answered by the caching protocol server
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    server = FakeLLMServer(caching=True).start()
    try:
        with CallLog(run / "llm_calls.sqlite") as log:
            LLMClient("openai/gpt-4.1", call_log=log, base_url=server.url + "/v1").run(
                [long_req(f"x{i}", 3) for i in range(3)])
    finally:
        server.stop()
    res = run_draco("report", str(run), "-o", str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr.decode()
    text = (tmp_path / "r.html").read_text()
    naive = billed_vs_naive(read_cost_rows(run / "llm_calls.sqlite"))
    total = naive.filter(pl.col("phase") == "all").to_dicts()[0]
    assert total["naive_calls"] == 9 and total["calls"] == 3
    assert f"draco paid <b>{total['billed_over_naive']:.3f}×</b>" in text
    assert f"{total['naive_usd']:.4f}" in text and f"{total['billed_usd']:.4f}" in text
    # the judge category holds the priced score calls' dollars; original the rollouts' tokens
    cat = text[text.index("id='cost-category'"):text.index("id='cost-naive'")]
    assert re.search(r"<td>judge</td><td class='num'>\d+</td><td>—</td><td class='num'>\d+"
                     rf"</td><td class='num'>{total['billed_usd']:.4f}</td>", cat), cat
    assert "<td>original</td>" in cat and "<td>rubric writing</td>" in cat
    chromium, flags = _chromium(tmp_path)
    dom = subprocess.run([chromium, *flags, "--dump-dom", f"file://{tmp_path / 'r.html'}"],
                         capture_output=True, timeout=120).stdout.decode()
    assert 'id="cost-naive"' in dom and '<table class="naive">' in dom
    assert len(re.findall(r'class="main-svg"', dom)) >= 1
