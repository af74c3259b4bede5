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


# --- #13: one locked output set per replay command ----------------------------------------

import pyarrow.parquet as pq  # noqa: E402

RUN_TABLES = ("labels.parquet", "replay_cost.parquet")
CORRECT_TABLES = ("credit.parquet", "token_advantages.parquet")


def set_ids(folder, names) -> set[str]:
    return {(pq.read_schema(folder / n).metadata or {}).get(b"draco.output_set", b"").decode()
            for n in names}


def popen_draco(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "draco_cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


def test_replay_outputs_carry_their_contracts_and_one_set_id(planned, tmp_path):
    out = tmp_path / "run"
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    env_cmd(), "-o", str(out))
    assert res.returncode == 0, res.stderr.decode()
    ids = set_ids(out, RUN_TABLES)
    assert len(ids) == 1 and len(ids.pop()) == 32
    assert pq.read_schema(out / "labels.parquet").metadata[b"draco.table"] == b"replay_labels"
    assert pq.read_schema(planned / "plan.parquet").metadata[b"draco.table"] == b"replay_plan"
    res = run_draco("validate", str(out), str(planned / "plan.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    err = res.stderr.decode()
    assert "replay_labels" in err and "replay_cost" in err and "replay_plan" in err, err
    # correct: credit and token advantages as one set; a member swapped in from another
    # write is a mixed set that validate names
    for name, extra in (("a", ()), ("b", ("--no-correction",))):
        res = run_draco("replay", "correct", "--plan", str(planned / "plan.parquet"),
                        "--labels", str(out / "labels.parquet"), "--rollouts",
                        str(planned / "rollouts.parquet"), "--steps",
                        str(planned / "steps.parquet"), "-o", str(tmp_path / name), *extra)
        assert res.returncode == 0, res.stderr.decode()
        assert len(set_ids(tmp_path / name, CORRECT_TABLES)) == 1
    assert run_draco("validate", str(tmp_path / "a")).returncode == 0
    (tmp_path / "a" / "credit.parquet").write_bytes((tmp_path / "b" / "credit.parquet")
                                                    .read_bytes())
    res = run_draco("validate", str(tmp_path / "a"))
    assert res.returncode == 1
    assert "come from different writes" in res.stderr.decode(), res.stderr.decode()


def test_validate_checks_replay_contracts(tmp_path):
    """Labels a user wrote with draco's metadata missing are checked by name of table
    (--table), and a non-finite return is named by row and field."""
    bad = pl.DataFrame({"rollout_id": ["r1", "r1"], "step": [1, 1],
                        "side": ["realized", "resampled"], "sample": [0, 0],
                        "return": [1.0, float("nan")]})
    path = tmp_path / "labels.parquet"
    bad.write_parquet(path)
    res = run_draco("validate", "--table", "replay_labels", "-", input=path.read_bytes())
    err = res.stderr.decode()
    assert res.returncode == 1 and "row 1" in err and "'return'" in err, err
    assert "Traceback" not in err


def test_two_replay_runs_into_one_folder_pay_each_replay_once(planned, tmp_path):
    """Two concurrent `replay run --force` into one folder: the second waits for the folder's
    lock, then finds every replay in the log; the environment serves each position once and
    one whole set is published."""
    out = tmp_path / "run"
    served = tmp_path / "served.txt"
    n_sel = int(pl.read_parquet(planned / "plan.parquet")["selected"].sum())
    args = ("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
            env_cmd("--delay", "0.05", "--served", str(served)), "-o", str(out), "--force")
    a = popen_draco(*args)
    b = popen_draco(*args)
    errs = []
    for p in (a, b):
        _, err = p.communicate(timeout=120)
        errs.append(err.decode())
        assert p.returncode == 0, err.decode()
    ids = [json.loads(x) for x in served.read_text().splitlines()]
    assert len(ids) == n_sel and len(set(ids)) == n_sel, "a replay was paid twice"
    assert any(f"0 replays run now, {n_sel} from the log" in e for e in errs), errs
    assert len(set_ids(out, RUN_TABLES)) == 1
    assert pl.read_parquet(out / "labels.parquet").height == n_sel * 2 * 2
    assert run_draco("validate", str(out)).returncode == 0


def test_kill_9_of_replay_run_over_an_older_set_keeps_it_whole(planned, tmp_path):
    """kill -9 of `replay run --force` (another plan) over an older output: the old labels and
    cost stay, whole and of one set; the rerun publishes the new set whole."""
    out = tmp_path / "run"
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    env_cmd(), "-o", str(out))
    assert res.returncode == 0, res.stderr.decode()
    old_ids = set_ids(out, RUN_TABLES)
    old = {n: pl.read_parquet(out / n) for n in RUN_TABLES}
    other = tmp_path / "other.parquet"
    res = run_draco("replay", "plan", "--positions", str(planned / "positions.parquet"),
                    "--steps", str(planned / "steps.parquet"), "--budget", "200", "--seed",
                    "11", "-o", str(other))
    assert res.returncode == 0, res.stderr.decode()
    p = popen_draco("replay", "run", "--plan", str(other), "--env",
                    env_cmd("--delay", "0.05"), "--workers", "1", "-o", str(out), "--force")
    from draco_cli.credo.protocol import plan_digest

    log = out / "replay_log.jsonl"
    digest = plan_digest(pl.read_parquet(other))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the kill lands mid-run of the new plan
        head = log.read_text().split("\n", 1)[0] if log.exists() else ""
        if digest in head and len(log_records(log)) >= 3:
            break
        time.sleep(0.02)
    n_new = int(pl.read_parquet(other)["selected"].sum())
    assert digest in log.read_text().split("\n", 1)[0]
    assert 3 <= len(log_records(log)) < n_new, "the kill must land mid-run"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    visible = sorted(x.name for x in out.iterdir() if not x.name.startswith("."))
    assert visible == sorted([*RUN_TABLES, "replay_log.jsonl"]), visible
    assert set_ids(out, RUN_TABLES) == old_ids
    for n in RUN_TABLES:
        assert pl.read_parquet(out / n).equals(old[n])
    assert run_draco("validate", str(out)).returncode == 0
    res = run_draco("replay", "run", "--plan", str(other), "--env", env_cmd(), "-o", str(out),
                    "--force")
    assert res.returncode == 0, res.stderr.decode()
    assert b"from the log of an earlier run" in res.stderr
    new_ids = set_ids(out, RUN_TABLES)
    assert len(new_ids) == 1 and new_ids != old_ids
    n_sel = int(pl.read_parquet(other)["selected"].sum())
    assert pl.read_parquet(out / "labels.parquet").select("rollout_id", "step").unique() \
        .height == n_sel
    assert run_draco("validate", str(out)).returncode == 0


def test_kill_9_of_replay_correct_force_leaves_one_whole_set(planned, tmp_path):
    """Random kill -9 of `replay correct --force` (with token advantages) over an older
    output: after every kill the folder holds the old set or the new one, whole."""
    import random

    run = tmp_path / "run"
    assert run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                     env_cmd(), "-o", str(run)).returncode == 0

    def args(out, *extra):
        return ("replay", "correct", "--plan", str(planned / "plan.parquet"), "--labels",
                str(run / "labels.parquet"), "--rollouts", str(planned / "rollouts.parquet"),
                "--steps", str(planned / "steps.parquet"), "-o", str(out), *extra)

    refs = {}
    for name, extra in (("old", ()), ("new", ("--no-correction",))):
        t0 = time.monotonic()
        assert run_draco(*args(tmp_path / name, *extra)).returncode == 0
        refs[name] = {n: pl.read_parquet(tmp_path / name / n) for n in CORRECT_TABLES}
    duration = time.monotonic() - t0
    out = tmp_path / "out"
    assert run_draco(*args(out)).returncode == 0
    rng = random.Random(7)
    seen = {"old": 0, "new": 0}
    deadline = time.monotonic() + 90
    kills = 0
    while kills < 8 and time.monotonic() < deadline:
        p = popen_draco(*args(out, "--no-correction", "--force"))
        time.sleep(rng.uniform(0.3, 1.1) * duration)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        kills += 1
        if (out / ".draco-publish.json").exists():  # killed between two renames
            from draco_cli.io import folder_lock
            from draco_cli.io.outputs import recover_folder

            with folder_lock(out):
                assert recover_folder(out)
        assert sorted(x.name for x in out.iterdir() if not x.name.startswith(".")) == \
            sorted(CORRECT_TABLES)
        assert len(set_ids(out, CORRECT_TABLES)) == 1
        got = {n: pl.read_parquet(out / n) for n in CORRECT_TABLES}
        which = [k for k, ref in refs.items()
                 if all(got[n].drop("settings", strict=False).equals(
                     ref[n].drop("settings", strict=False)) for n in CORRECT_TABLES)]
        assert len(which) == 1, "a mixed set"
        seen[which[0]] += 1
        if which[0] == "new":
            assert run_draco(*args(out, "--force")).returncode == 0
        assert run_draco("validate", str(out)).returncode == 0
    print(f"kill -9 outcomes after {kills} kills: {seen}")
    assert kills >= 3 and seen["old"] >= 1, seen


def test_an_environment_that_fails_from_the_start_stops_the_run_and_says_why(planned,
                                                                             tmp_path):
    # a wrong --env used to fail every selected position one by one, its reason unseen
    missing = tmp_path / "my_env_adapter.py"
    res = run_draco("replay", "run", "--plan", str(planned / "plan.parquet"), "--env",
                    f"{sys.executable} {missing}", "--workers", "1", "-o", str(tmp_path / "o"))
    err = res.stderr.decode()
    assert res.returncode == 1 and "stopped: the environment failed its first 3 replays" in err
    assert "can't open file" in err and str(missing) in err and "not tried" in err, err
    assert not (tmp_path / "o" / "labels.parquet").exists()
