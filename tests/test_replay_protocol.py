"""The replay protocol end to end: plan → run (an external environment program) → correct,
through the chain simulator shipped in examples/, with kill -9 and resume, and over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import polars as pl
import pytest

from tests.conftest import REPO, run_draco

CHAIN = REPO / "examples" / "chain_env.py"


def env_cmd(*extra: str) -> str:
    return " ".join([sys.executable, str(CHAIN), "serve", "--seed", "3", *extra])


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    d = tmp_path_factory.mktemp("chain")
    subprocess.run([sys.executable, str(CHAIN), "generate", "--n", "40", "--seed", "3", "-o",
                    str(d)], check=True)
    res = run_draco("replay", "plan", "--positions", str(d / "positions.parquet"), "--steps",
                    str(d / "steps.parquet"), "--budget", "200", "--seed", "5", "-o",
                    str(d / "plan.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    return d


def log_records(path):
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines()[1:] if x.endswith("}")]


def test_run_kill9_resume_then_correct(planned, tmp_path):
    plan = pl.read_parquet(planned / "plan.parquet")
    n_sel = int(plan["selected"].sum())
    assert n_sel >= 12
    out = tmp_path / "run"
    served = tmp_path / "served.txt"
    cmd = [sys.executable, "-m", "draco_cli", "replay", "run", "--plan",
           str(planned / "plan.parquet"), "--env", env_cmd("--delay", "0.05", "--served",
                                                           str(served)),
           "--workers", "2", "-o", str(out)]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(log_records(out / "replay_log.jsonl")) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    before = {r["id"] for r in log_records(out / "replay_log.jsonl")}
    assert 4 <= len(before) < n_sel, "the kill must land mid-run"
    assert not (out / "labels.parquet").exists()          # no half-written labels
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    env_cmd("--served", str(served)), "--workers", "2", "-o", str(out))
    assert res.returncode == 0, res.stderr.decode()
    assert f"{len(before)} from the log".encode() in res.stderr
    served_ids = [json.loads(x) for x in served.read_text().splitlines()]
    for i in before:                                      # nothing finished is run twice
        assert served_ids.count(i) == 1, i
    labels = pl.read_parquet(out / "labels.parquet")
    assert labels.select("rollout_id", "step").unique().height == n_sel
    assert labels.height == n_sel * 2 * 2                 # K = 2 per side
    # the same plan run straight through gives the same labels (seeds per position)
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    env_cmd(), "-o", str(tmp_path / "straight"), "--workers", "1")
    assert res.returncode == 0, res.stderr.decode()
    straight = pl.read_parquet(tmp_path / "straight" / "labels.parquet")
    key = ["rollout_id", "step", "side", "sample"]
    assert labels.sort(key).equals(straight.sort(key))
    # cost: K(T − t) + K(T − t + 1) environment actions per replayed position, T = 4
    cost = pl.read_parquet(out / "replay_cost.parquet")
    assert cost.with_columns((2 * (4 - pl.col("step")) + 2 * (4 - pl.col("step") + 1))
                             .alias("want")).filter(pl.col("want") != pl.col("env_actions")
                                                    ).height == 0
    sel = plan.filter(pl.col("selected"))
    assert cost["env_actions"].sum() == sel["cost"].sum()  # the plan's unit is the same
    # a rerun does nothing twice and the loop closes with correct
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    env_cmd("--served", str(served)), "-o", str(out), "--force")
    assert res.returncode == 0 and b"0 replays run now" in res.stderr
    res = run_draco("replay", "correct", "--plan", str(planned / "plan.parquet"), "--labels",
                    str(out / "labels.parquet"), "-o", str(tmp_path / "credo"))
    assert res.returncode == 0, res.stderr.decode()
    credit = pl.read_parquet(tmp_path / "credo" / "credit.parquet")
    assert credit.filter(pl.col("selected"))["delta"].null_count() == 0


def test_failing_environment_writes_no_labels(planned, tmp_path):
    bad = (f"{sys.executable} -c \"import sys,json\nfor l in sys.stdin:\n r=json.loads(l)\n "
           f"print(json.dumps({{'id': r['id'], 'realized': [1.0], 'resampled': [0.0, 0.0]}}),"
           f" flush=True)\"")
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env", bad,
                    "-o", str(tmp_path / "bad"))
    assert res.returncode == 1
    assert b"realized must be a list of 2 numbers" in res.stderr
    assert b"Traceback" not in res.stderr
    assert not (tmp_path / "bad" / "labels.parquet").exists()
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    "/nonexistent/env-program", "-o", str(tmp_path / "none"))
    assert res.returncode != 0 and b"could not start" in res.stderr
    assert b"Traceback" not in res.stderr
    # a log of another plan is refused
    other = pl.read_parquet(planned / "plan.parquet").with_columns(pl.lit(True).alias("selected"))
    other.write_parquet(tmp_path / "other.parquet")
    (tmp_path / "bad" / "replay_log.jsonl").write_text('{"protocol": "draco-replay/1", '
                                                       '"plan": "0000"}\n')
    res = run_draco("replay", "run", "--plan", str(tmp_path / "other.parquet"), "--env",
                    env_cmd(), "-o", str(tmp_path / "bad"))
    assert res.returncode == 2 and b"log of another plan" in res.stderr


def test_http_transport_gives_the_same_labels(planned, tmp_path):
    srv = subprocess.Popen([sys.executable, str(CHAIN), "serve", "--seed", "3", "--http", "0"],
                           stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(srv.stdout.readline())["port"]
        res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                        f"http://127.0.0.1:{port}/replay", "--workers", "3", "-o",
                        str(tmp_path / "http"))
        assert res.returncode == 0, res.stderr.decode()
    finally:
        srv.kill()
        srv.wait()
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    env_cmd(), "-o", str(tmp_path / "pipe"))
    assert res.returncode == 0, res.stderr.decode()
    key = ["rollout_id", "step", "side", "sample"]
    assert pl.read_parquet(tmp_path / "http" / "labels.parquet").sort(key).equals(
        pl.read_parquet(tmp_path / "pipe" / "labels.parquet").sort(key))
    res = run_draco("replay", "diagnose", "--plan", str(planned / "plan.parquet"), "--labels",
                    str(tmp_path / "pipe" / "labels.parquet"), "--json", "-o",
                    str(tmp_path / "diag"))
    assert res.returncode == 0, res.stderr.decode()
    d = json.loads(res.stdout)
    plan = pl.read_parquet(planned / "plan.parquet")
    sel = plan.filter(pl.col("selected"))
    assert d["weights"]["max_weight"] == pytest.approx(float((1 / sel["p"]).max()))
    assert d["variance_split"]["positions"] == sel.height
    assert (tmp_path / "diag" / "allocator_calibration.parquet").exists()
    res = run_draco("audit", "cost", "--calls", "sample_data/llm_calls.sqlite", "--replay-cost",
                    str(tmp_path / "pipe"), "-o", str(tmp_path / "cost"))
    assert res.returncode == 0, res.stderr.decode()
    cat = pl.read_parquet(tmp_path / "cost" / "cost_category.parquet")
    replay = cat.filter(pl.col("category") == "replay")
    assert replay["env_actions"][0] == sel["cost"].sum()


def test_a_hung_environment_times_out_and_the_rest_still_runs(planned, tmp_path):
    """An environment that never answers one request: that replay fails after --timeout, a
    fresh copy of the environment serves the others, no labels until a rerun completes it."""
    plan = pl.read_parquet(planned / "plan.parquet")
    victim = plan.filter(pl.col("selected")).row(0, named=True)
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import json, subprocess, sys, time\n"
        f"real = subprocess.Popen([{sys.executable!r}, {str(CHAIN)!r}, 'serve', '--seed', '3'],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        f"    if r['id'] == {victim['rollout_id'] + '#' + str(victim['step'])!r} and "
        f"not __import__('os').path.exists({str(tmp_path / 'healed')!r}):\n"
        "        time.sleep(60)\n"
        "    real.stdin.write(line); real.stdin.flush()\n"
        "    sys.stdout.write(real.stdout.readline()); sys.stdout.flush()\n")
    cmd = f"{sys.executable} {hang}"
    t0 = time.monotonic()
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env", cmd,
                    "--timeout", "1", "--workers", "1", "-o", str(tmp_path / "out"))
    assert res.returncode == 1 and b"no answer within 1 s" in res.stderr
    assert time.monotonic() - t0 < 40
    n_sel = int(plan["selected"].sum())
    assert len(log_records(tmp_path / "out" / "replay_log.jsonl")) == n_sel - 1
    assert not (tmp_path / "out" / "labels.parquet").exists()
    (tmp_path / "healed").write_text("")
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env", cmd,
                    "--timeout", "5", "-o", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr.decode()
    assert b"1 replays run now" in res.stderr
