"""A fleet of judges (draco_cli/llm/pool.py): several local OpenAI-compatible servers for one
model, calls spread by fewest outstanding, one server killed mid-run and its calls retried on the
others, per-endpoint figures in the call log, bad endpoint lists refused in one line."""

from __future__ import annotations

import sqlite3
import threading

import polars as pl
import pytest

from draco_cli.llm.export import endpoint_totals
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.test_run import SAMPLE_RA, SAMPLE_SA, draco, paid_twice, wait_for

TABLES = ["rubric/rubrics.parquet", "judge/verdicts.parquet", "credit/rewards.parquet",
          "credit/token_advantages.parquet"]


@pytest.fixture
def fleet(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-fleet-00000000000")
    servers = [FakeLLMServer(answer=scripted, latency=0.1).start() for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


def run(out, urls, *extra):
    args = [a for u in urls for a in ("--base-url", u + "/v1")]
    return draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                 *args, "--concurrency", "6", "--no-adapt", "-o", out, *extra)


def test_one_endpoint_killed_mid_run(fleet, tmp_path):
    single = FakeLLMServer(answer=scripted).start()
    try:
        assert run(tmp_path / "one", [single.url]).returncode == 0
    finally:
        single.stop()
    victim = fleet[1]

    def kill() -> None:
        wait_for(lambda: victim.hits["chat"] >= 4, "the victim to serve 4 calls")
        victim.stop()

    killer = threading.Thread(target=kill)
    killer.start()
    res = run(tmp_path / "fleet", [s.url for s in fleet])
    killer.join()
    assert res.returncode == 0, res.stderr
    for t in TABLES:   # the same answers, so the same tables as one server
        assert pl.read_parquet(tmp_path / "fleet" / t).equals(
            pl.read_parquet(tmp_path / "one" / t)), t
    log = tmp_path / "fleet" / "llm_calls.sqlite"
    assert paid_twice(log) == 0
    totals = endpoint_totals(log)
    urls = [s.url + "/v1" for s in fleet]
    assert set(totals) == set(urls)
    assert all(totals[u]["answered"] > 0 for u in urls)        # all three took calls
    assert totals[urls[1]]["failed"] > 0                        # the killed one failed some
    assert totals[urls[0]]["failed"] == totals[urls[2]]["failed"] == 0
    served_after = sum(totals[u]["answered"] for u in (urls[0], urls[2]))
    assert served_after + totals[urls[1]]["answered"] == 30     # 18 rubric + 12 judge calls
    con = sqlite3.connect(log)
    errors = [e for (e,) in con.execute("select error from calls where status='http_error'")]
    assert errors and all(urls[1] in e for e in errors)


def test_least_outstanding_favours_the_fast_endpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-fleet-00000000000")
    fast = FakeLLMServer(answer=scripted, latency=0.02).start()
    slow = FakeLLMServer(answer=scripted, latency=0.6).start()
    try:
        res = run(tmp_path / "r", [slow.url, fast.url], "--concurrency", "4")
    finally:
        fast.stop()
        slow.stop()
    assert res.returncode == 0, res.stderr
    assert fast.hits["chat"] >= 3 * slow.hits["chat"] > 0


def test_all_endpoints_down_fails_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-fleet-00000000000")
    a, b = FakeLLMServer().start(), FakeLLMServer().start()
    a.stop(), b.stop()
    res = run(tmp_path / "r", [a.url, b.url])
    assert res.returncode == 1
    assert "connection refused" in res.stderr and "Traceback" not in res.stderr
    assert f"[{a.url}/v1]" in res.stderr or f"[{b.url}/v1]" in res.stderr


@pytest.mark.parametrize("bad, says", [
    ("localhost:8000/v1", "is not an http(s) URL"),
    ("http://127.0.0.1:99999/v1", "has a bad port"),
])
def test_bad_endpoint_refused(tmp_path, bad, says):
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                "--base-url", "http://127.0.0.1:1/v1", "--base-url", bad, "-o", tmp_path / "r")
    assert res.returncode == 2 and says in res.stderr and bad in res.stderr


def test_endpoint_file(fleet, tmp_path):
    listing = tmp_path / "judges.txt"
    listing.write_text("# two replicas\n" + "\n".join(s.url + "/v1" for s in fleet[:2]) + "\n")
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                "--base-url", listing, "-o", tmp_path / "r")
    assert res.returncode == 0, res.stderr
    assert fleet[0].hits["chat"] > 0 and fleet[1].hits["chat"] > 0 and not fleet[2].hits
    bad = tmp_path / "bad.txt"
    bad.write_text(fleet[0].url + "/v1\nftp://x\n")
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                "--base-url", bad, "-o", tmp_path / "r2")
    assert res.returncode == 2 and f"{bad} line 2" in res.stderr
