"""Defaults a training loop relies on (issue 31's traps): ``draco run`` calls the judge online
unless ``--batch`` asks otherwise, and a step that gives the trainer no learning signal fails
the run (exit 1, the reason, a report banner) unless ``--allow-no-signal``."""

from __future__ import annotations

import json

import polars as pl
import pytest

from draco_cli.llm.client import LLMClient
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.test_run import SAMPLE_RA, SAMPLE_SA, draco


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def test_draco_run_calls_online_where_the_offline_commands_would_batch(server, tmp_path,
                                                                      monkeypatch):
    # as for openai/gpt-4.1 on the hosted API, where the offline commands batch by default
    monkeypatch.setattr(LLMClient, "batches_by_default", lambda self, provider: True)
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                "--base-url", server.url + "/v1", "-o", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    assert server.hits["files"] == 0 and not server.batches     # no batch was sent
    assert "batch API" not in res.stderr
    server.batch_polls = 0     # the batch has ended at its first poll
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                "--base-url", server.url + "/v1", "-o", tmp_path / "batched", "--batch")
    assert res.returncode == 0, res.stderr
    assert server.batches, "--batch asked for the batch API"
    assert "batch API (half price; answers typically within hours" in res.stderr


def one_rollout_groups(tmp_path):
    p = tmp_path / "single.parquet"
    pl.read_parquet(SAMPLE_RA).with_columns(pl.col("rollout_id").alias("group_id")) \
        .write_parquet(p)
    return p


def test_no_signal_fails_the_run_unless_allowed(tmp_path):
    single = one_rollout_groups(tmp_path)
    res = draco("run", "--rollouts", single, "--steps", SAMPLE_SA, "--setting", "outcome",
                "-o", tmp_path / "run")
    assert res.returncode == 1
    assert "no rollout of 12 has a non-zero advantage" in res.stderr
    assert "signal check failed" in res.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "unhealthy" and manifest["health"]["signal"]["ok"] is False
    res = draco("run", "--rollouts", single, "--steps", SAMPLE_SA, "--setting", "outcome",
                "-o", tmp_path / "run", "--allow-no-signal")
    assert res.returncode == 0, res.stderr
    assert "no learning signal (allowed)" in res.stderr
    assert draco("report", tmp_path / "run", "-o", tmp_path / "r.html").returncode == 0
    assert "No learning signal" in (tmp_path / "r.html").read_text()
    # groups of four with differing outcomes: a signal, healthy
    ok = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--setting", "outcome",
               "-o", tmp_path / "grouped")
    assert ok.returncode == 0, ok.stderr


def test_a_judge_that_passes_everything_is_no_signal(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")

    def passes(body, i):
        out = json.loads(scripted(body, i))
        for v in out.get("verdicts", []):
            v["verdict"] = "pass"
        return json.dumps(out)

    s = FakeLLMServer(answer=passes).start()
    try:
        res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model",
                    "openai/m", "--base-url", s.url + "/v1", "-o", tmp_path / "run")
    finally:
        s.stop()
    assert res.returncode == 1
    assert "criteria was dropped by the filter" in res.stderr


def test_credit_expand_keeps_every_column_the_loader_checks(tmp_path):
    import numpy as np

    from draco_cli.inloop import BlockingStepScorer, TrainerRollout, write_step
    from draco_cli.trainers.loader import AlignmentError, load_token_advantages

    rng = np.random.default_rng(1)
    mask = [1] * 5 + [0] * 3 + [1] * 4
    rollouts = [TrainerRollout(f"r{k}", "g", "task", rng.integers(0, 99, len(mask)), mask,
                               outcome=float(k % 2), train_step=7) for k in range(4)]
    with BlockingStepScorer("mock/j", call_log=tmp_path / "c.sqlite", group_size=4,
                            decode=lambda ids: " ".join(map(str, ids))) as s:
        folder = write_step(s.score_step(rollouts, 7), tmp_path / "steps")
    spans = folder / "credit" / "token_advantages.parquet"
    dense = tmp_path / "dense.parquet"
    assert draco("credit", "expand", "--token-advantages", spans, "-o", dense).returncode == 0
    ids = [r.rollout_id for r in rollouts]
    resp = np.stack([np.asarray(r.response_ids) for r in rollouts])
    m = np.tile(np.asarray(mask), (4, 1))
    tables = [load_token_advantages(p) for p in (spans, dense)]
    np.testing.assert_array_equal(tables[0].batch(ids, m, train_step=7, response_ids=resp),
                                  tables[1].batch(ids, m, train_step=7, response_ids=resp))
    for t in tables:
        assert t.train_step("r0") == 7
        with pytest.raises(AlignmentError):        # rows swapped under equal masks
            t.batch(ids, m, response_ids=resp[[1, 0, 2, 3]])
        with pytest.raises(AlignmentError):        # a mask one token short
            t.batch(ids, np.concatenate([m[:, :-1], np.zeros((4, 1), int)], axis=1))
        with pytest.raises(AlignmentError):        # another step's file
            t.batch(ids, m, train_step=8)


def test_a_run_folder_of_other_inputs_is_refused_unless_restarted(tmp_path):
    out = tmp_path / "run"
    assert draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--setting", "outcome",
                 "-o", out).returncode == 0
    other, other_steps = tmp_path / "other.parquet", tmp_path / "other_steps.parquet"
    r = pl.read_parquet(SAMPLE_RA).head(8)
    r.write_parquet(other)
    pl.read_parquet(SAMPLE_SA).filter(pl.col("rollout_id").is_in(r["rollout_id"].implode())) \
        .write_parquet(other_steps)
    res = draco("run", "--rollouts", other, "--steps", other_steps, "--setting", "outcome",
                "-o", out)
    assert res.returncode == 2 and "holds a run of other rollouts" in res.stderr
    assert pl.read_parquet(out / "credit" / "rewards.parquet").height == 12   # untouched
    res = draco("run", "--rollouts", other, "--steps", other_steps, "--setting", "outcome",
                "-o", out, "--restart")
    assert res.returncode == 0, res.stderr
    assert pl.read_parquet(out / "credit" / "rewards.parquet").height == 8


def test_a_failed_run_says_so_in_its_manifest(tmp_path):
    out = tmp_path / "run"
    bad = tmp_path / "bad.parquet"
    pl.read_parquet(SAMPLE_RA).with_columns(pl.lit(float("inf")).alias("outcome")) \
        .write_parquet(bad)
    res = draco("run", "--rollouts", bad, "--steps", SAMPLE_SA, "--setting", "outcome",
                "-o", out)
    assert res.returncode in (1, 2)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "outcome" in manifest["error"]


def test_another_process_on_the_call_log_is_no_corruption(server, tmp_path):
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    assert draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                 "--base-url", server.url + "/v1", "-o", out).returncode == 0
    log = out / "llm_calls.sqlite"
    # another process takes the log exclusively for 6.5 s, longer than SQLite's default 5 s busy wait (a user's sqlite3, DuckDB, a
    # backup), while a rerun opens it
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"c = sqlite3.connect({str(log)!r}, isolation_level=None)\n"
        "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(6.5)\n"
        "c.execute('COMMIT')\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model",
                    "openai/m", "--base-url", server.url + "/v1", "-o", out, "--samples", "2")
    finally:
        holder.wait(timeout=30)
    assert res.returncode == 0, res.stderr
    assert "corrupt" not in res.stderr and time.monotonic() - t0 >= 5.0


def test_a_damaged_call_log_is_still_called_corrupt(tmp_path):
    from draco_cli.llm.calllog import CallLog

    log = tmp_path / "llm_calls.sqlite"
    with CallLog(log) as c:
        c.record(request_hash="h", sample=0, phase="score", provider="p", model="m",
                 status="ok", answer_text="{}")
    data = bytearray(log.read_bytes())
    data[100:4096] = b"\x07" * (4096 - 100)   # the schema page overwritten
    log.write_bytes(bytes(data))
    with pytest.raises(Exception, match="corrupt call log|not a SQLite"):
        with CallLog(log):
            pass


def test_the_python_api_checks_its_inputs_like_the_cli(server, tmp_path):
    import asyncio

    from draco_cli.errors import InputError
    from draco_cli.inloop import Scorer
    from draco_cli.trainers.loader import AlignmentError, load_token_advantages

    r = pl.read_parquet(SAMPLE_RA)
    s = pl.read_parquet(SAMPLE_SA)
    g = r["group_id"][0]
    mine = r.filter(pl.col("group_id") == g)
    theirs = s.filter(~pl.col("rollout_id").is_in(mine["rollout_id"].implode()))

    async def score(rollouts, steps):
        async with Scorer("openai/m", base_url=server.url + "/v1",
                          call_log=tmp_path / "c.sqlite") as sc:
            return await sc.score_group(rollouts, steps)

    with pytest.raises(InputError, match="which is not in group"):
        asyncio.run(score(mine, s))                       # another group's steps too
    with pytest.raises(InputError, match="no steps for any rollout"):
        asyncio.run(score(mine, s.head(0)))
    with pytest.raises(InputError, match="no rollouts"):
        asyncio.run(score(mine.head(0), s))
    assert theirs.height   # the sample has other groups
    scored = asyncio.run(score(mine.drop("outcome"), s.filter(
        pl.col("rollout_id").is_in(mine["rollout_id"].implode()))))   # outcome is optional
    assert scored.rewards.height == mine.height

    out = tmp_path / "run"
    assert draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--setting", "outcome",
                 "-o", out).returncode == 0
    t = load_token_advantages(out / "credit" / "token_advantages.parquet")
    ids = r["rollout_id"].to_list()[:2]
    with pytest.raises(AlignmentError, match="length -1"):
        t.batch(ids, length=-1)
    with pytest.raises(AlignmentError, match="train_step has 3 entries for 2 trainer rows"):
        t.batch(ids, length=4000, train_step=[0, 0, 0])
    with pytest.raises(AlignmentError, match="give response_mask"):
        t.batch(ids)
    assert t.batch(ids, length=4000, strict=False).shape == (2, 4000)

    huge = tmp_path / "huge.parquet"
    r.with_columns(pl.when(pl.col("outcome") > 0).then(1e308).otherwise(-1e308)
                   .alias("outcome")).write_parquet(huge)
    res = draco("run", "--rollouts", huge, "--steps", SAMPLE_SA, "--setting", "outcome",
                "-o", tmp_path / "huge")
    assert res.returncode == 1 and "overflow" in res.stderr and "outcome" in res.stderr
    assert "internal error" not in res.stderr
    empty = tmp_path / "empty.parquet"
    r.head(0).write_parquet(empty)
    res = draco("run", "--rollouts", empty, "--steps", SAMPLE_SA, "--setting", "outcome",
                "-o", tmp_path / "empty")
    assert res.returncode != 0, "zero rollouts gave exit 0"


def test_an_unanswered_merge_leaves_the_group_its_candidates(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")

    def no_merge(body, i):
        if "curate the final" in body["messages"][1]["content"]:
            return "not json at all"
        return scripted(body, i)

    s = FakeLLMServer(answer=no_merge).start()
    try:
        res = draco("rubric", "generate", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA,
                    "--model", "openai/m", "--base-url", s.url + "/v1", "--parse-retries", "0",
                    "-o", tmp_path / "rb")
    finally:
        s.stop()
    rubrics = pl.read_parquet(tmp_path / "rb" / "rubrics.parquet")
    groups = pl.read_parquet(SAMPLE_RA)["group_id"].unique()
    assert set(rubrics["group_id"]) == set(groups)            # every group keeps criteria
    assert set(rubrics["source"]) <= {"generate", "union"}
    assert "whose merge call went unanswered are judged on their candidates" in res.stderr

