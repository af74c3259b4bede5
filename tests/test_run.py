"""draco run: the README's commands as written, the five settings, stage keys that follow what
each stage reads, the manifest as stages finish, the health check, the folder lock, resume
after kill -9 and Ctrl-C, and run folders read from anywhere (report, eval, audit).

Commands run in-process (the CLI's entry point, ``run_draco``) unless a real process is the
point: the README command, kill -9, Ctrl-C and two concurrent writers."""

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


from tests.conftest import REPO, TAU, run_draco, sample_step
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted

SAMPLE_R = "sample_data/appworld_mini/rollouts.parquet"
SAMPLE_S = "sample_data/appworld_mini/steps.parquet"


def test_sample_tables_match_a_fresh_ingest(tmp_path):
    assert draco("ingest", "openai-jsonl", REPO / "sample_data" / "appworld_mini.jsonl",
                 "--step-unit", "code-block",
                 "--code-language", "python", "--tokenizer", "approx", "-o",
                 tmp_path).returncode == 0
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
    assert manifest["prompt_versions"]["score"] == "score.v4"
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


SAMPLE_RA = str(REPO / SAMPLE_R)
SAMPLE_SA = str(REPO / SAMPLE_S)
REPLAY = "replay/" + str(REPO / "sample_data" / "llm_calls.sqlite")
SAMPLE_CALLS = 18 + 12  # 12 generate + 3 union + 3 merge; 12 judge calls


class Result:
    def __init__(self, code: int, stderr: str) -> None:
        self.returncode, self.stderr = code, stderr


def draco(*args: str, cwd=None) -> Result:
    """The CLI's entry point in this process (``run_draco``), stderr as text."""
    res = run_draco(*args, cwd=cwd)
    return Result(res.returncode, res.stderr.decode())


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def calls_in(log) -> int:
    con = sqlite3.connect(log)
    try:
        return con.execute("select count(*) from calls").fetchone()[0]
    finally:
        con.close()


def paid_twice(log) -> int:
    con = sqlite3.connect(log)
    try:
        return con.execute("select count(*) from (select request_hash, sample from calls where "
                           "status='ok' group by 1, 2 having count(*) > 1)").fetchone()[0]
    finally:
        con.close()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-run-000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def run_sample(server, out, *extra: str, rollouts: str = SAMPLE_RA) -> Result:
    return draco("run", "--rollouts", rollouts, "--steps", SAMPLE_SA, "--model", "openai/m",
                 "--base-url", server.url + "/v1", "-o", out, *extra)


@pytest.mark.parametrize("setting,credit_mode,rubric_calls", [
    ("draco", "step", True), ("no-credit", "uniform", True),
    ("static", "step", False), ("static-no-credit", "uniform", False)])
def test_four_settings(server, tmp_path, setting, credit_mode, rubric_calls):
    res = run_sample(server, tmp_path, "--setting", setting, "--train-step", "3",
                     rollouts=sample_step(3, tmp_path / "in")[1])
    assert res.returncode == 0, res.stderr
    run = tmp_path / "step-3"
    rewards = pl.read_parquet(run / "credit" / "rewards.parquet")
    modes = set(rewards["credit_mode"])
    assert credit_mode in modes and modes <= {credit_mode, "grpo_fallback"}
    systems = [b["messages"][0]["content"] + b["messages"][1]["content"] for b in server.bodies]
    assert any("This request: write grading criteria" in s for s in systems) == rubric_calls
    rb = pl.read_parquet(run / "rubric" / "rubrics.parquet")
    assert set(rb["source"]) == ({"merge"} if rubric_calls else {"static"})
    m = json.loads((run / "manifest.json").read_text())
    assert m["train_step"] == 3 and m["settings"]["setting"] == setting
    assert m["manifest_version"] == 2 and m["health"]["ok"] is True
    assert "next: draco report" in res.stderr


def test_outcome_setting_is_vanilla_grpo_without_llm(tmp_path):
    """The paper's control: GRPO on the environment outcome, uniform over policy tokens, no
    model, no call log. Advantages are the group-standardised outcomes (sample std, verl's)."""
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--setting", "outcome",
                "-o", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    assert "mean reward (filtered)" not in res.stderr and "environment outcome" in res.stderr
    run = tmp_path / "run"
    assert not (run / "llm_calls.sqlite").exists() and not (run / "judge").exists()
    rw = pl.read_parquet(run / "credit" / "rewards.parquet")
    r = pl.read_parquet(SAMPLE_RA)
    assert set(rw["credit_mode"]) == {"uniform"}
    joined = rw.join(r.select("rollout_id", "outcome"), on="rollout_id")
    assert (joined["reward"] == joined["outcome"].cast(pl.Float64)).all()
    expect = joined.with_columns(
        ((pl.col("outcome") - pl.col("outcome").mean().over("group_id"))
         / (pl.col("outcome").std(ddof=1).over("group_id") + 1e-6)).alias("expect"))
    assert (expect["advantage"] - expect["expect"]).abs().max() < 1e-12
    ta = pl.read_parquet(run / "credit" / "token_advantages.parquet")
    values = ta.explode("span_value").group_by("rollout_id").agg(
        pl.col("span_value").unique().alias("v"))
    adv = dict(zip(rw["rollout_id"], rw["advantage"]))
    for rid, v in values.iter_rows():
        # every policy token of a rollout carries its A_i (stored as float32)
        assert len(v) == 1 and v[0] == pytest.approx(adv[rid], rel=1e-6)
    m = json.loads((run / "manifest.json").read_text())
    assert set(m["stages"]) == {"credit"} and m["health"]["stages"] == {}
    assert m["health"]["signal"]["ok"] is True and m["health"]["ok"] is True
    # the other settings still need a model
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "-o", tmp_path / "x")
    assert res.returncode == 2 and "--model is required" in res.stderr


def test_tau_bench_end_to_end(server, tmp_path):
    d = tmp_path / "tau"
    assert draco("ingest", "tau-bench", TAU, "--tokenizer", "approx",
                 "-o", d).returncode == 0
    res = draco("run", "--rollouts", d / "rollouts.parquet", "--steps", d / "steps.parquet",
                "--model", "openai/m", "--base-url", server.url + "/v1", "--samples", "3",
                "--max-criteria", "5", "-o", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    assert server.hits["chat"] == 60 + 15 + 15 + 60
    ta = pl.read_parquet(tmp_path / "run" / "credit" / "token_advantages.parquet")
    assert ta.height == 60


@pytest.mark.parametrize("args,flag", [
    (["--tokens", "bogus"], "--tokens"), (["--std", "bogus"], "--std"),
    (["--train-step", "-1"], "--train-step"), (["--redo", "everything"], "--redo"),
    (["--min-answered", "1.5"], "--min-answered"), (["--redact", "("], "--redact"),
    (["--max-cost", "-1"], "--max-cost"), (["--timeout", "0"], "--timeout"),
    (["--setting", "outcome", "--credit", "step"], "--credit"),
    (["--judge-model", "nonsense"], "model 'nonsense'"),
    (["--judge-model", "replay//nonexistent.sqlite"], "nonexistent.sqlite"),
    (["--static-rubric", "/nonexistent.yaml", "--setting", "static"], "nonexistent.yaml")])
def test_bad_options_refused_before_any_call(server, tmp_path, args, flag):
    res = run_sample(server, tmp_path / "r", *args)
    assert res.returncode in (1, 2) and flag in res.stderr, res.stderr
    assert res.returncode == 2 or "nonexistent" in flag or "model" in flag
    assert server.hits["chat"] == 0 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("table, column, value, words", [
    ("rollouts", "outcome", pl.lit("yes"), "field 'outcome': expected double, got String"),
    ("steps", "n_tokens", pl.lit(-5), "field 'n_tokens': must be >= 1, got -5"),
    ("steps", "step", pl.col("step") + 100, "field 'step'"),
])
def test_a_table_the_credit_stage_refuses_is_refused_before_any_call(server, tmp_path, table,
                                                                       column, value, words):
    # the LLM stages read only the text columns: what credit would refuse is checked first
    paths = {"rollouts": SAMPLE_RA, "steps": SAMPLE_SA}
    bad = tmp_path / f"{table}.parquet"
    df = pl.read_parquet(paths[table])
    df.with_columns(pl.when(pl.int_range(pl.len()) == 1).then(value)
                    .otherwise(pl.col(column)).alias(column)).write_parquet(bad)
    paths[table] = str(bad)
    res = draco("run", "--rollouts", paths["rollouts"], "--steps", paths["steps"], "--model",
                "openai/m", "--base-url", server.url + "/v1", "-o", tmp_path / "r")
    assert res.returncode == 1 and f"error: {bad}: row " in res.stderr and words in res.stderr, \
        res.stderr
    assert server.hits["chat"] == 0


@pytest.mark.parametrize("setting", ["draco", "outcome"])
def test_rollouts_of_another_train_step_are_refused_before_any_call(server, tmp_path, setting):
    # the trainer's loader refuses step N's token advantages when their rows say another step:
    # found at training time, after every judge call of the step was paid for
    res = run_sample(server, tmp_path / "r", "--train-step", "1", "--setting", setting)
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith(f"error: {SAMPLE_RA}: field 'train_step': train_step is 0 in "
                                 "some rows, not --train-step 1"), res.stderr
    assert server.hits["chat"] == 0 and not (tmp_path / "r").exists()
    # rollouts that do not say their step take the run's
    unlabelled = tmp_path / "rollouts.parquet"
    pl.read_parquet(SAMPLE_RA).with_columns(pl.lit(None, pl.Int32).alias("train_step")
                                            ).write_parquet(unlabelled)
    res = run_sample(server, tmp_path / "r", "--train-step", "1", "--setting", "outcome",
                     rollouts=str(unlabelled))
    assert res.returncode == 0, res.stderr
    path = tmp_path / "r" / "step-1" / "credit" / "token_advantages.parquet"
    ta = pl.read_parquet(path)
    assert set(ta["train_step"]) == {1}
    from draco_cli.trainers.loader import AlignmentError, load_token_advantages

    table, ids = load_token_advantages(path), ta["rollout_id"][:2].to_list()
    width = max(ta["length"][:2])
    assert table.batch(ids, length=width, train_step=1).shape == (2, width)  # the trainer takes it
    with pytest.raises(AlignmentError, match="from train step 1"):
        table.batch(ids, length=width, train_step=2)


def test_the_run_step_through_the_python_api(tmp_path):
    from draco_cli.errors import UsageError
    from draco_cli.options import RunOptions
    from draco_cli.run.pipeline import run_step

    outcome = RunOptions.for_setting("outcome")
    with pytest.raises(UsageError, match="--train-step -1: must be"):
        run_step(SAMPLE_RA, SAMPLE_SA, tmp_path / "neg", None, outcome, train_step=-1)
    # a train_step column as text is read as the credit stage reads it: "1" is step 1
    text = tmp_path / "text.parquet"
    pl.read_parquet(SAMPLE_RA).with_columns(pl.lit("1").alias("train_step")).write_parquet(text)
    res = run_step(text, SAMPLE_SA, tmp_path / "runs", None, outcome, train_step=1)
    assert res.run_dir == tmp_path / "runs" / "step-1" and res.manifest["train_step"] == 1
    # the step given in the credit options is the run's step, not only the files' label
    res = run_step(text, SAMPLE_SA, tmp_path / "runs2", None, RunOptions.for_setting(
        "outcome", credit_options={"train_step": 1}))
    assert res.run_dir == tmp_path / "runs2" / "step-1" and res.manifest["train_step"] == 1
    ta = pl.read_parquet(res.run_dir / "credit" / "token_advantages.parquet")
    assert set(ta["train_step"]) == {1}


def test_stage_keys_follow_what_each_stage_reads(server, tmp_path):
    rubric = tmp_path / "r.yaml"
    rubric.write_text("criteria:\n  - title: Alpha\n    requirement: Does alpha.\n")
    run = tmp_path / "run"
    args = ("--setting", "static", "--static-rubric", rubric)
    assert run_sample(server, run, *args).returncode == 0
    assert set(pl.read_parquet(run / "rubric" / "rubrics.parquet")["title"]) == {"Alpha"}
    # same path, new contents: the rubric and everything after it are redone
    rubric.write_text("criteria:\n  - title: Alpha\n    requirement: Does alpha.\n"
                      "  - title: Beta\n    requirement: Does beta.\n")
    res = run_sample(server, run, *args)
    assert res.returncode == 0 and "skipped" not in res.stderr, res.stderr
    assert set(pl.read_parquet(run / "rubric" / "rubrics.parquet")["title"]) == {"Alpha", "Beta"}
    # credit is keyed on the verdicts it reads, not on the judge's settings
    v = pl.read_parquet(run / "judge" / "verdicts.parquet")
    flipped = v.with_columns(pl.when(pl.col("verdict") == "pass").then(pl.lit("fail"))
                             .otherwise(pl.lit("pass")).alias("verdict"))
    flipped.write_parquet(run / "judge" / "verdicts.parquet")
    hits = server.hits["chat"]
    res = run_sample(server, run, *args)
    assert res.returncode == 0 and "skipped: rubric, judge\n" in res.stderr, res.stderr
    assert "credit: done" in res.stderr and server.hits["chat"] == hits
    fresh = tmp_path / "fresh"
    assert draco("credit", "compute", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA,
                 "--verdicts", run / "judge" / "verdicts.parquet", "-o", fresh).returncode == 0
    assert pl.read_parquet(run / "credit" / "rewards.parquet").equals(
        pl.read_parquet(fresh / "rewards.parquet"))
    # rm -rf RUN/judge: judging is redone (from the call log, no new call), then credit too
    shutil.rmtree(run / "judge")
    res = run_sample(server, run, *args)
    assert res.returncode == 0 and "skipped: rubric\n" in res.stderr, res.stderr
    assert "credit: done" in res.stderr and server.hits["chat"] == hits
    # another server (--base-url) is another judge: redone, answered from the call log
    other = FakeLLMServer(answer=scripted).start()
    try:
        res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                    "--base-url", other.url + "/v1", "-o", run, *args)
        assert res.returncode == 0 and "judge: done" in res.stderr, res.stderr
    finally:
        other.stop()


def test_redo_forces_a_stage_and_what_follows(server, tmp_path):
    run = tmp_path / "run"
    assert run_sample(server, run).returncode == 0
    assert server.hits["chat"] == SAMPLE_CALLS
    res = run_sample(server, run, "--redo", "judge")
    assert res.returncode == 0, res.stderr
    assert "rubric: reused" in res.stderr and "judge: done" in res.stderr
    assert "credit: done" in res.stderr
    assert "judge: done" in res.stderr and \
        "answered 12 of 12 requests (100%) (0 new, 12 reused)" in res.stderr
    assert server.hits["chat"] == SAMPLE_CALLS  # answers already logged are reused


def _garbage_for_judge(state):
    def answer(body, i):
        if state["broken"] and "strict grader" in body["messages"][1]["content"]:
            return "I think it passes."
        return scripted(body, i)
    return answer


def test_health_check_fails_the_run_and_a_rerun_asks_again(server, tmp_path):
    """A judge whose answers are unusable: exit 1 with the reason, health in the manifest; the
    stage is not done, so a rerun asks exactly the unanswered calls again."""
    state = {"broken": True}
    server.answer = _garbage_for_judge(state)
    run = tmp_path / "run"
    res = run_sample(server, run, "--parse-retries", "0")
    assert res.returncode == 1, res.stderr
    # one figure, the same words in the stage line and the health message
    assert "judge: answered 0 of 12 requests (0%), under --min-answered 90%" in res.stderr
    assert ", answered 0 of 12 requests (0%) (12 new, 0 reused)" in res.stderr
    assert "Traceback" not in res.stderr
    assert "judge: partial" in res.stderr and "unanswered ×12: " in res.stderr
    m = json.loads((run / "manifest.json").read_text())
    h = m["health"]
    assert h["ok"] is False and h["threshold"] == 0.9 and m["status"] == "unhealthy"
    assert h["stages"]["rubric"] == {"requests": 18, "answered": 18, "answered_share": 1.0,
                                     "reasons": {}, "ok": True}
    judge = h["stages"]["judge"]
    assert (judge["requests"], judge["answered"], judge["ok"]) == (12, 0, False)
    assert sum(judge["reasons"].values()) == 12 and h["messages"]
    assert m["stages"]["judge"]["status"] == "partial"
    # the threshold is a flag
    res = run_sample(server, tmp_path / "lenient", "--parse-retries", "0", "--min-answered", "0",
                     "--allow-no-signal")   # no verdict at all: no signal either
    assert res.returncode == 0 and "some calls went unanswered" in res.stderr
    # fixed server: the rerun asks only the 12 unanswered judge calls
    state["broken"] = False
    hits = server.hits["chat"]
    res = run_sample(server, run, "--parse-retries", "0")
    assert res.returncode == 0, res.stderr
    assert "rubric: reused" in res.stderr and server.hits["chat"] - hits == 12
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "done" and m["health"]["ok"] is True


def test_run_folder_opens_from_anywhere_and_after_a_move(tmp_path):
    a = tmp_path / "a"
    (a / "data").mkdir(parents=True)
    shutil.copy(SAMPLE_RA, a / "data" / "rollouts.parquet")
    shutil.copy(SAMPLE_SA, a / "data" / "steps.parquet")
    res = draco("run", "--rollouts", "data/rollouts.parquet", "--steps", "data/steps.parquet",
                "--model", REPLAY, "-o", "runs", "--train-step", "0", cwd=a)
    assert res.returncode == 0, res.stderr
    m = json.loads((a / "runs" / "step-0" / "manifest.json").read_text())
    assert m["inputs"]["rollouts"]["path"] == str(a / "data" / "rollouts.parquet")
    assert m["inputs"]["rollouts"]["relative"] == "../../data/rollouts.parquet"
    b = tmp_path / "moved"
    shutil.move(a, b)
    run = b / "runs" / "step-0"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = draco("report", run, "-o", "r.html", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert "spotify" in (elsewhere / "r.html").read_text()  # the steps were found and drawn
    res = draco("eval", "--rollouts", run, "-o", "ev", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert pl.read_parquet(elsewhere / "ev" / "metrics.parquet").height
    res = draco("audit", "cost", "--calls", run, "-o", "cost", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    # a rerun from elsewhere, through the moved inputs, is a no-op
    res = draco("run", "--rollouts", b / "data" / "rollouts.parquet", "--steps",
                b / "data" / "steps.parquet", "--model", REPLAY, "-o", b / "runs",
                "--train-step", "0", cwd=elsewhere)
    assert res.returncode == 0 and "skipped: rubric, judge, credit" in res.stderr, res.stderr
    # an input that changed since the run is refused by name, not read as if the same
    pl.read_parquet(b / "data" / "rollouts.parquet").head(4).write_parquet(
        b / "data" / "rollouts.parquet")
    res = draco("eval", "--rollouts", run, cwd=elsewhere)
    assert res.returncode == 1 and "changed since the run" in res.stderr


def test_corrupt_manifest_is_one_line_saying_what_to_do(tmp_path):
    run = tmp_path / "run"
    assert draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", REPLAY,
                 "-o", run).returncode == 0
    (run / "manifest.json").write_text('{"stages": {"rubric": ')
    for args in (("report", run, "-o", tmp_path / "r.html"), ("eval", "--rollouts", run),
                 ("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", REPLAY,
                  "-o", run)):
        res = draco(*args)
        assert res.returncode == 1, (args, res.stderr)
        lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and "corrupt manifest" in lines[0] and "rerun" in lines[0]
    assert "delete it and rerun" in lines[0]  # the run itself says how to get past it
    (run / "manifest.json").unlink()
    res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", REPLAY,
                "-o", run)
    assert res.returncode == 0 and "(0 new, " in res.stderr, res.stderr


def test_missing_inputs_are_named_not_a_traceback(tmp_path):
    res = draco("run", "--rollouts", tmp_path / "nope.parquet", "--steps",
                tmp_path / "nope.parquet", "--model", "openai/x", "-o", tmp_path / "r")
    assert res.returncode == 1
    assert "nope.parquet: no such file" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()


# -- real processes: kill -9, Ctrl-C, two writers ----------------------------------------------

def _spawn(server, out, *extra: str, stderr=subprocess.DEVNULL):
    return subprocess.Popen(
        [sys.executable, "-m", "draco_cli", "run", "--rollouts", SAMPLE_RA, "--steps",
         SAMPLE_SA, "--model", "openai/m", "--base-url", server.url + "/v1", "-o", str(out),
         "--concurrency", "2", *extra],
        cwd=REPO, stderr=stderr, stdout=subprocess.DEVNULL)


def test_kill_mid_judging_leaves_a_manifest_and_resumes_paying_nothing_twice(server, tmp_path):
    server.latency = 0.1
    run = tmp_path / "run"
    proc = _spawn(server, run)
    try:
        wait_for(lambda: server.hits["chat"] >= 18 + 3, "judging to start")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "running" and m["stages"]["rubric"]["status"] == "done"
    assert m["stages"]["judge"]["status"] == "running" and "credit" not in m["stages"]
    assert not (run / "credit").exists()
    con = sqlite3.connect(run / "llm_calls.sqlite")
    logged = con.execute("select count(*) from calls where status = 'ok'").fetchone()[0]
    con.close()
    server.latency = 0.0
    before = server.hits["chat"]
    res = run_sample(server, run)
    assert res.returncode == 0, res.stderr
    assert "rubric: reused" in res.stderr
    assert paid_twice(run / "llm_calls.sqlite") == 0
    # the resumed run asks exactly what the killed one had not got logged
    assert server.hits["chat"] - before == SAMPLE_CALLS - logged
    assert (run / "credit" / "token_advantages.parquet").exists()


def test_ctrl_c_exits_130_saying_how_to_resume(server, tmp_path):
    server.latency = 0.1
    run = tmp_path / "run"
    proc = _spawn(server, run, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: server.hits["chat"] >= 18 + 3, "judging to start")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 130, err
    assert "interrupted: rerun the same command to resume" in err and "Traceback" not in err
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "interrupted" and m["stages"]["judge"]["status"] == "interrupted"


def test_two_runs_into_one_folder_pay_each_call_once(server, tmp_path):
    server.latency = 0.2
    run = tmp_path / "run"
    first = _spawn(server, run, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: server.hits["chat"] >= 1, "the first run to call")
        second = _spawn(server, run, stderr=subprocess.PIPE)
        try:
            # while the first holds the folder, --no-wait refuses with a clear message
            res = run_sample(server, run, "--no-wait")
            assert res.returncode == 1 and "another draco run (pid" in res.stderr
            _, err1 = first.communicate(timeout=120)
            _, err2 = second.communicate(timeout=120)
        finally:
            if second.poll() is None:
                second.kill()
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    assert b"waiting: another draco run" in err2
    assert b"skipped: rubric, judge, credit" in err2
    assert server.hits["chat"] == SAMPLE_CALLS
    assert paid_twice(run / "llm_calls.sqlite") == 0


def test_audits_over_run_folders_of_several_steps(tmp_path):
    """Issue 13: self-judge over run folders of different steps agrees with itself per step;
    audit cost keeps a run folder without a train step in the per-step table."""
    for step in ("0", "1"):
        assert draco("run", *sample_step(int(step), tmp_path / "in"), "--model", REPLAY,
                     "-o", tmp_path / "runs", "--train-step", step).returncode == 0
    assert draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", REPLAY,
                 "-o", tmp_path / "nostep").returncode == 0
    s0, s1 = tmp_path / "runs" / "step-0", tmp_path / "runs" / "step-1"
    res = draco("audit", "self-judge", "--self", s0, "--reference", s0, "--self", s1,
                "--reference", s1, "-o", tmp_path / "sj")
    assert res.returncode == 0, res.stderr
    ag = pl.read_parquet(tmp_path / "sj" / "agreement.parquet")
    rows = {r["scope"]: r for r in ag.iter_rows(named=True)}
    assert rows["step:0"]["agreement"] == rows["step:1"]["agreement"] == 1.0
    assert rows["overall"]["unanswered_rate"] == 0.0
    res = draco("audit", "self-judge", "--self", s0, "--reference", s0, "--rollouts",
                SAMPLE_RA, "-o", tmp_path / "sj2")
    assert res.returncode == 2 and "run folders carry their own rollouts" in res.stderr
    res = draco("audit", "cost", "--calls", s0, "--calls", s1, "--calls", tmp_path / "nostep",
                "-o", tmp_path / "cost")
    assert res.returncode == 0, res.stderr
    per_step = pl.read_parquet(tmp_path / "cost" / "cost_step.parquet")
    assert per_step["train_step"].to_list() == [0, 1, None]
    assert per_step["calls"].to_list() == [SAMPLE_CALLS] * 3


def test_outcome_setting_matches_verls_grpo(tmp_path):
    """Same rewards → the same advantages as verl's compute_grpo_outcome_advantage, except a
    group of one member: verl gives it A = r (mean 0, std 1), draco 0 (SPEC §3.5: no baseline,
    no signal). Runs where verl is installed (it needs torch, ray and transformers)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    import numpy as np
    import torch

    r = pl.read_parquet(SAMPLE_RA)
    s = pl.read_parquet(SAMPLE_SA)
    # a group of one: keep only the first member of the first group
    first = r["group_id"][0]
    keep = r.filter((pl.col("group_id") != first) | (pl.col("rollout_id") == r["rollout_id"][0]))
    keep.write_parquet(tmp_path / "r.parquet")
    s.join(keep.select("rollout_id"), on="rollout_id").write_parquet(tmp_path / "s.parquet")
    res = draco("run", "--rollouts", tmp_path / "r.parquet", "--steps", tmp_path / "s.parquet",
                "--setting", "outcome", "-o", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    rw = pl.read_parquet(tmp_path / "run" / "credit" / "rewards.parquet").join(
        keep.select("rollout_id", "outcome"), on="rollout_id")
    n, length = rw.height, 5
    token_rewards = torch.zeros((n, length), dtype=torch.float64)
    token_rewards[:, -1] = torch.tensor(rw["outcome"].cast(pl.Float64).to_list())
    mask = torch.ones((n, length), dtype=torch.float64)
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, np.array(rw["group_id"].to_list(), dtype=object))
    verl = adv[:, 0].numpy()
    draco_adv = rw["advantage"].to_numpy()
    single = (rw["group_id"] == first).to_numpy()
    assert single.sum() == 1
    np.testing.assert_allclose(draco_adv[~single], verl[~single], rtol=0, atol=1e-12)
    assert draco_adv[single][0] == 0.0
    assert verl[single][0] == pytest.approx(rw["outcome"][int(np.argmax(single))] / (1 + 1e-6))


def test_python_api_takes_the_same_option_objects(tmp_path):
    from draco_cli.errors import UsageError
    from draco_cli.options import RunOptions
    from draco_cli.run.pipeline import run_step

    with pytest.raises(UsageError, match="--tokens 'bogus'"):
        RunOptions.for_setting("outcome", credit_options={"tokens": "bogus"})
    with pytest.raises(UsageError, match="--model is required"):
        run_step(SAMPLE_RA, SAMPLE_SA, tmp_path / "x", None, RunOptions.for_setting("static"))
    events = []
    res = run_step(sample_step(2, tmp_path / "in")[1], SAMPLE_SA, tmp_path / "runs",
                   None, RunOptions.for_setting("outcome", credit_options={"tokens": "dense"}),
                   train_step=2, on_event=events.append)
    assert res.healthy and res.manifest["status"] == "done"
    assert res.run_dir == tmp_path / "runs" / "step-2"
    assert [(e.stage, e.event) for e in events] == [("credit", "start"), ("credit", "end")]
    ta = pl.read_parquet(res.run_dir / "credit" / "token_advantages.parquet")
    assert "advantages" in ta.columns


def test_manifest_versions(tmp_path):
    """A version-1 manifest (paths as typed, relative to where draco ran) still opens; a
    manifest from a newer draco is refused with what to do."""
    from draco_cli.errors import InputError
    from draco_cli.io.files import file_sha256
    from draco_cli.run.folder import RunFolder

    run = tmp_path / "old"
    run.mkdir()
    shutil.copy(SAMPLE_RA, run / "rollouts.parquet")
    (run / "manifest.json").write_text(json.dumps({
        "status": "done", "train_step": 4, "stages": {},
        "inputs": {"rollouts": {"path": "rollouts.parquet",
                                "sha256": file_sha256(run / "rollouts.parquet")}}}))
    folder = RunFolder.open(run)
    assert folder.manifest.manifest_version == 1 and folder.train_step == 4
    assert folder.rollouts == run / "rollouts.parquet"
    (run / "manifest.json").write_text(json.dumps({"manifest_version": 99, "stages": {}}))
    with pytest.raises(InputError, match="newer than this draco reads"):
        RunFolder.open(run)


def test_validate_a_run_folder(tmp_path):
    run = tmp_path / "run"
    assert draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", REPLAY,
                 "-o", run).returncode == 0
    res = draco("validate", run)
    assert res.returncode == 0, res.stderr
    for table in ("12 rollouts", "48 steps", "40 verdicts", "12 rewards", "12 token_advantages"):
        assert table in res.stderr


def test_unwritable_run_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        res = draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--setting",
                    "outcome", "-o", out)
        assert res.returncode == 1 and "cannot write the run folder" in res.stderr, res.stderr
    assert (tmp_path / "file").read_text() == "x"


def test_call_log_option_shares_one_log_across_steps(server, tmp_path):
    log = tmp_path / "calls.sqlite"
    assert run_sample(server, tmp_path / "runs", "--train-step", "0", "--call-log",
                      log).returncode == 0
    assert not (tmp_path / "runs" / "step-0" / "llm_calls.sqlite").exists()
    assert calls_in(log) == SAMPLE_CALLS
    # the same rollouts at the next step: every answer comes from the shared log
    res = run_sample(server, tmp_path / "runs", "--train-step", "1", "--call-log", log,
                     rollouts=sample_step(1, tmp_path / "in")[1])
    assert res.returncode == 0, res.stderr
    assert "rubric: done" in res.stderr and "answered 18 of 18 requests (100%) (0 new, 18 reused)" in res.stderr, res.stderr
    assert server.hits["chat"] == SAMPLE_CALLS
    res = draco("audit", "cost", "--calls", tmp_path / "runs" / "step-0", "-o", tmp_path / "c")
    assert res.returncode == 0, res.stderr  # found through the manifest


def test_credit_stage_takes_arrow_buffers_from_the_c_heap_and_gives_the_pool_back(
        tmp_path, monkeypatch):
    """In ``draco run`` the credit stage runs with Arrow on the system allocator (the memory
    the LLM stages freed is handed back first), and the caller's pool is restored after it,
    also when the stage fails; the tables are the same as with Arrow's own pool."""
    import pyarrow as pa

    import draco_cli.credit as credit_ops
    from draco_cli.run.pipeline import run_step
    from draco_cli.options import RunOptions

    before = pa.default_memory_pool()
    seen: list[str] = []
    real = credit_ops.credit_compute

    def spy(*args, **kwargs):
        seen.append(pa.default_memory_pool().backend_name)
        return real(*args, **kwargs)

    monkeypatch.setattr(credit_ops, "credit_compute", spy)
    opts = RunOptions.for_setting("outcome")
    res = run_step(SAMPLE_RA, SAMPLE_SA, tmp_path / "runs", None, opts)
    assert seen == ["system"] and pa.default_memory_pool().backend_name == before.backend_name
    direct = tmp_path / "direct"
    real(SAMPLE_RA, SAMPLE_SA, None, direct, options=opts.credit)   # Arrow's own pool
    for name in ("rewards", "step_credit", "token_advantages"):
        assert pl.read_parquet(res.run_dir / "credit" / f"{name}.parquet").equals(
            pl.read_parquet(direct / f"{name}.parquet"))

    def boom(*args, **kwargs):
        raise RuntimeError("credit failed")

    monkeypatch.setattr(credit_ops, "credit_compute", boom)
    with pytest.raises(RuntimeError, match="credit failed"):
        run_step(SAMPLE_RA, SAMPLE_SA, tmp_path / "runs2", None, opts)
    assert pa.default_memory_pool().backend_name == before.backend_name
