"""draco run: the README's commands as written, the four settings, resume after a kill, and the
real tau-bench sample against the local protocol server."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import polars as pl
import pytest

from tests.conftest import REPO, TAU, run_draco
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted

SAMPLE_R = "sample_data/appworld_mini/rollouts.parquet"
SAMPLE_S = "sample_data/appworld_mini/steps.parquet"


def test_sample_tables_match_a_fresh_ingest(tmp_path):
    assert run_draco("ingest", "openai-jsonl", "sample_data/appworld_mini.jsonl", "--step-unit",
                     "code-block", "--tokenizer", "approx", "-o", str(tmp_path)).returncode == 0
    for t in ("rollouts", "steps"):
        assert pl.read_parquet(tmp_path / f"{t}.parquet").equals(
            pl.read_parquet(REPO / "sample_data" / "appworld_mini" / f"{t}.parquet")), t


def test_readme_main_command_runs_as_written(tmp_path):
    """The README's first block, run in a fresh folder holding the sample (pip install is the
    environment this test already runs in)."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
    main = [c.split("&&", 1)[1].strip() for c in block.splitlines()
            if c.startswith("pip install -e .") and "draco run" in c]
    assert len(main) == 1
    shutil.copytree(REPO / "sample_data", tmp_path / "sample_data")
    args = main[0].split()[1:]
    res = subprocess.run([sys.executable, "-m", "draco_cli", *args], cwd=tmp_path,
                         capture_output=True)
    assert res.returncode == 0, res.stderr.decode()
    assert b"runs/demo/credit/token_advantages.parquet" in res.stderr
    ta = pl.read_parquet(tmp_path / "runs/demo/credit/token_advantages.parquet")
    assert ta.height == 12
    manifest = json.loads((tmp_path / "runs/demo/manifest.json").read_text())
    assert manifest["status"] == "done"
    # 4 rollouts x 4 criteria (spotify) + 4 x 3 (venmo) + 4 x 3 (amazon)
    assert manifest["rows"]["judge/verdicts.parquet"] == 40
    assert manifest["prompt_versions"]["score"] == "score.v2"
    assert set(manifest["inputs"]) == {"rollouts", "steps"}
    # idempotent: a finished run reruns with zero calls and skips every stage
    before = sqlite3.connect(tmp_path / "runs/demo/llm_calls.sqlite").execute(
        "select count(*) from calls").fetchone()[0]
    res = subprocess.run([sys.executable, "-m", "draco_cli", *args], cwd=tmp_path,
                         capture_output=True)
    assert res.returncode == 0 and b"skipped: rubric, judge, credit" in res.stderr
    after = sqlite3.connect(tmp_path / "runs/demo/llm_calls.sqlite").execute(
        "select count(*) from calls").fetchone()[0]
    assert after == before


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-run-000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


@pytest.mark.parametrize("setting,credit_mode,rubric_calls", [
    ("draco", "step", True), ("no-credit", "uniform", True),
    ("static", "step", False), ("static-no-credit", "uniform", False)])
def test_four_settings(server, tmp_path, setting, credit_mode, rubric_calls):
    res = run_draco("run", "--rollouts", SAMPLE_R, "--steps", SAMPLE_S, "--model",
                    "openai/m", "--base-url", server.url + "/v1", "--setting", setting,
                    "--train-step", "3", "-o", str(tmp_path))
    assert res.returncode == 0, res.stderr.decode()
    run = tmp_path / "step-3"
    rewards = pl.read_parquet(run / "credit" / "rewards.parquet")
    modes = set(rewards["credit_mode"])
    assert credit_mode in modes and modes <= {credit_mode, "grpo_fallback"}
    systems = [b["messages"][0]["content"] for b in server.bodies]
    assert any("write grading criteria" in s for s in systems) == rubric_calls
    rb = pl.read_parquet(run / "rubric" / "rubrics.parquet")
    assert set(rb["source"]) == ({"merge"} if rubric_calls else {"static"})
    m = json.loads((run / "manifest.json").read_text())
    assert m["train_step"] == 3 and m["settings"]["setting"] == setting


def test_tau_bench_end_to_end(server, tmp_path):
    d = tmp_path / "tau"
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(d)).returncode == 0
    res = run_draco("run", "--rollouts", str(d / "rollouts.parquet"), "--steps",
                    str(d / "steps.parquet"), "--model", "openai/m", "--base-url",
                    server.url + "/v1", "--samples", "3", "--max-criteria", "5",
                    "-o", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr.decode()
    assert server.hits["chat"] == 60 + 15 + 15 + 60
    ta = pl.read_parquet(tmp_path / "run" / "credit" / "token_advantages.parquet")
    assert ta.height == 60


KILL = """
import sys
sys.argv = ["draco", "run", "--rollouts", sys.argv[1], "--steps", sys.argv[2], "--model",
            "openai/m", "--base-url", sys.argv[3], "-o", sys.argv[4], "--concurrency", "2"]
from draco_cli.cli import main
main()
"""


def test_kill_and_resume(server, tmp_path):
    d = tmp_path / "tau"
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(d)).returncode == 0
    server.latency = 0.05
    proc = subprocess.Popen([sys.executable, "-c", KILL, str(d / "rollouts.parquet"),
                             str(d / "steps.parquet"), server.url + "/v1", str(tmp_path / "run")],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.DEVNULL)
    while server.hits["chat"] < 40:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "run" / "credit").exists()
    server.latency = 0.0
    res = run_draco("run", "--rollouts", str(d / "rollouts.parquet"), "--steps",
                    str(d / "steps.parquet"), "--model", "openai/m", "--base-url",
                    server.url + "/v1", "-o", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr.decode()
    con = sqlite3.connect(tmp_path / "run" / "llm_calls.sqlite")
    dup = con.execute("select count(*) from (select request_hash, sample from calls where "
                      "status='ok' group by 1, 2 having count(*) > 1)").fetchone()[0]
    assert dup == 0
    assert (tmp_path / "run" / "credit" / "token_advantages.parquet").exists()


def test_missing_inputs_are_named_not_a_traceback(tmp_path):
    res = run_draco("run", "--rollouts", str(tmp_path / "nope.parquet"), "--steps",
                    str(tmp_path / "nope.parquet"), "--model", "openai/x", "-o",
                    str(tmp_path / "r"))
    assert res.returncode == 1
    assert b"nope.parquet: no such file" in res.stderr and b"Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()
