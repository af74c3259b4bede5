"""The in-loop API (draco_cli.inloop): groups scored concurrently give the tables ``draco run``
writes for the same inputs and answers; a rerun pays nothing; the per-call deadline holds; the
example in docs/inloop.md runs as written."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import subprocess
import sys
import time

import polars as pl
import pytest

from draco_cli import inloop as api
from draco_cli.errors import InputError
from tests.conftest import REPO
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.test_run import SAMPLE_RA, SAMPLE_SA, draco

KEYS = {"rubrics": ["group_id", "criterion_id"],
        "verdicts_raw": ["rollout_id", "criterion_id", "judge", "sample"],
        "verdicts": ["rollout_id", "criterion_id", "judge"],
        "rewards": ["rollout_id"], "step_credit": ["rollout_id", "step"],
        "token_advantages": ["rollout_id"]}
FILES = {"rubrics": "rubric/rubrics.parquet", "verdicts_raw": "judge/verdicts_raw.parquet",
         "verdicts": "judge/verdicts.parquet", "rewards": "credit/rewards.parquet",
         "step_credit": "credit/step_credit.parquet",
         "token_advantages": "credit/token_advantages.parquet"}


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted, latency=0.05).start()
    yield s
    s.stop()


def groups_of(rollouts: pl.DataFrame, steps: pl.DataFrame):
    for (gid,), r in rollouts.partition_by("group_id", as_dict=True, maintain_order=True).items():
        yield r, steps.filter(pl.col("rollout_id").is_in(r["rollout_id"].implode()))


async def score_all(server, log, **kw):
    rollouts, steps = pl.read_parquet(SAMPLE_RA), pl.read_parquet(SAMPLE_SA)
    async with api.Scorer("openai/m", base_url=server.url + "/v1", call_log=log,
                          concurrency=8, **kw) as scorer:
        scored = await asyncio.gather(*(scorer.score_group(r, s)
                                        for r, s in groups_of(rollouts, steps)))
    return scored, scorer


def calls(log) -> int:
    con = sqlite3.connect(log)
    try:
        return con.execute("select count(*) from calls").fetchone()[0]
    finally:
        con.close()


def test_groups_scored_concurrently_equal_draco_run(server, tmp_path):
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                "--base-url", server.url + "/v1", "-o", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    filtered = tmp_path / "filtered.parquet"
    assert draco("judge", "filter", "--rollouts", SAMPLE_RA, "--verdicts",
                 tmp_path / "run" / FILES["verdicts"], "-o", filtered).returncode == 0
    scored, scorer = asyncio.run(score_all(server, tmp_path / "api" / "llm_calls.sqlite"))
    assert len(scored) == 3 and all(g.calls.answered > 0 and g.calls.cached == 0
                                    for g in scored)
    for name, keys in KEYS.items():
        mine = pl.concat([getattr(g, name) for g in scored], how="diagonal_relaxed")
        # the filter's retained flags ride on the in-loop verdicts, as draco judge filter's
        theirs = pl.read_parquet(filtered if name == "verdicts" else
                                 tmp_path / "run" / FILES[name])
        cols = [c for c in theirs.columns if c in mine.columns]
        assert set(theirs.columns) <= set(mine.columns), name
        a = mine.select(cols).sort(keys)
        b = theirs.select(cols).sort(keys).cast(dict(a.schema))
        assert a.height == b.height > 0, name
        assert a.equals(b), name
    assert pl.concat([g.verdicts for g in scored])["retained"].value_counts().height == 2
    # the groups overlapped: one call log, one client, calls of several groups in flight
    assert scorer._clients["rubric"].limit.maximum == 8


def test_rerun_pays_nothing(server, tmp_path):
    log = tmp_path / "llm_calls.sqlite"
    first, _ = asyncio.run(score_all(server, log))
    n, hits = calls(log), sum(server.hits.values())
    again, scorer = asyncio.run(score_all(server, log))
    assert calls(log) == n and sum(server.hits.values()) == hits
    assert all(g.calls.answered == 0 and g.calls.cached > 0 for g in again)
    assert scorer.cost_usd == 0.0
    for a, b in zip(first, again):
        assert a.token_advantages.equals(b.token_advantages)


def test_deadline_is_honoured(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    slow = FakeLLMServer(answer=scripted, latency=5.0).start()
    try:
        t = time.perf_counter()
        scored, _ = asyncio.run(score_all(slow, tmp_path / "log.sqlite", deadline=0.5))
        took = time.perf_counter() - t
    finally:
        slow.stop()
    assert took < 4.0          # far below one 5 s answer, let alone a group's chain of calls
    for g in scored:
        assert g.calls.answered == 0 and g.calls.unanswered > 0
        assert any("deadline (0.5 s)" in r for r in g.calls.reasons)
        assert g.rubrics.height == 0            # nothing to judge by: no verdicts either
        assert g.token_advantages.height == g.rewards.height > 0
    con = sqlite3.connect(tmp_path / "log.sqlite")
    assert con.execute("select count(*) from calls where status='unanswered' and error like "
                       "'%deadline%'").fetchone()[0] > 0


def test_one_group_per_call(server, tmp_path):
    async def go():
        async with api.Scorer("openai/m", base_url=server.url + "/v1",
                              call_log=tmp_path / "l.sqlite") as scorer:
            await scorer.score_group(pl.read_parquet(SAMPLE_RA), pl.read_parquet(SAMPLE_SA))

    with pytest.raises(InputError, match="one group's rollouts, got 3 groups"):
        asyncio.run(go())


@pytest.mark.parametrize("block", [0, 1])
def test_docs_example_runs(tmp_path, block):
    text = (REPO / "docs" / "inloop.md").read_text()
    codes = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(codes) == 2, "a Python block of docs/inloop.md that no test runs"
    script = tmp_path / "example.py"
    script.write_text(codes[block])
    res = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                         text=True, timeout=120,
                         env={**__import__("os").environ, "DRACO_EXAMPLE_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    if block == 0:
        assert "3 groups scored" in res.stdout
    else:   # the step's rows, and a step that gives the trainer a signal
        assert "q0-0 draco" in res.stdout and "'draco/signal_ok': 1.0" in res.stdout
        assert (tmp_path / "steps/step-000003/credit/token_advantages.parquet").is_file()
