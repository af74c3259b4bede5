"""Fail loudly (issue 13): a corpus of bad inputs, faults and crashes, run through the real CLI.

Every case ends in a one-line error naming the file, row, field or option, exit 1 (bad input,
failure) or 2 (usage), no traceback, and nothing that existed before destroyed.
"""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest

from draco_cli.io import write_table
from draco_cli.schemas import VerdictAggregated
from tests.conftest import SAMPLE, TAU2, run_draco, write_jsonl


def one_line_error(res, code: int, *needles: str) -> str:
    """The command failed with ``code``, one 'error:' line, no traceback, naming ``needles``."""
    err = res.stderr.decode()
    assert res.returncode == code, err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(folder) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (hidden bookkeeping files included)."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """A real ingest of the sample, with verdicts and a credit output beside it."""
    d = tmp_path_factory.mktemp("sample")
    res = run_draco("ingest", "openai-jsonl", str(SAMPLE), "--step-unit", "code-block",
                    "--code-language", "python",
                    "--tokenizer", "approx", "-o", str(d / "data"))
    assert res.returncode == 0, res.stderr.decode()
    steps = pl.read_parquet(d / "data" / "steps.parquet")
    rollouts = pl.read_parquet(d / "data" / "rollouts.parquet")
    rng = np.random.default_rng(0)
    m = dict(steps.group_by("rollout_id").len().iter_rows())
    rows = [{"rollout_id": rid, "criterion_id": f"c{c}", "judge": "j",
             "verdict": str(rng.choice(["pass", "fail"])), "cited_steps": [1, m[rid]] if rid in m else [],
             "reason": "r"} for rid in rollouts["rollout_id"] for c in range(4)]
    write_table(pl.DataFrame(rows, schema_overrides={"cited_steps": pl.List(pl.Int32)}),
                d / "data" / "verdicts.parquet", VerdictAggregated)
    return d / "data"


def credit_args(data, out, rollouts=None, verdicts=None):
    return ("credit", "compute", "--rollouts", str(rollouts or data / "rollouts.parquet"),
            "--steps", str(data / "steps.parquet"),
            "--verdicts", str(verdicts or data / "verdicts.parquet"), "-o", str(out))


# --- 1. never silently wrong: NaN / ±inf ----------------------------------------------------

NON_FINITE = [("nan", "NaN"), ("inf", "Infinity"), ("-inf", "-Infinity")]


@pytest.mark.parametrize("shown,literal", NON_FINITE, ids=[n for n, _ in NON_FINITE])
def test_ingest_openai_jsonl_non_finite_outcome(tmp_path, chat_row, shown, literal):
    src = tmp_path / "x.jsonl"
    good = json.dumps(chat_row(rollout_id="a"))
    bad = json.dumps(chat_row(rollout_id="b", outcome=0.5)).replace("0.5", literal)
    src.write_text(good + "\n" + bad + "\n")
    res = run_draco("ingest", "openai-jsonl", str(src), "-o", str(tmp_path / "out"))
    one_line_error(res, 1, "x.jsonl", "line 2", "field 'outcome'", shown)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.parquet"))


@pytest.mark.parametrize("shown,literal", NON_FINITE, ids=[n for n, _ in NON_FINITE])
def test_ingest_tau2_non_finite_reward(tmp_path, shown, literal):
    doc = json.loads(TAU2.read_text())
    doc["simulations"] = doc["simulations"][:3]
    doc["simulations"][2]["reward_info"]["reward"] = 0.123456
    text = json.dumps(doc).replace("0.123456", literal)
    bad = tmp_path / "t2.json"
    bad.write_text(text)
    res = run_draco("ingest", "tau2-bench", str(bad), "-o", str(tmp_path / "out"))
    one_line_error(res, 1, "t2.json", "simulations[2]", "field 'reward_info.reward'", shown)


def _rollouts_with_outcome(data, tmp_path, value, row=3):
    r = pl.read_parquet(data / "rollouts.parquet")
    outcome = r["outcome"].to_list()
    outcome[row] = value
    path = tmp_path / "rollouts.parquet"
    # written as a plain Parquet file, as a user's own script would
    r.with_columns(pl.Series("outcome", outcome, dtype=pl.Float64)).write_parquet(path)
    return path


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_credit_compute_reward_outcome_refuses_non_finite(sample, tmp_path, value):
    bad = _rollouts_with_outcome(sample, tmp_path, value)
    out = tmp_path / "credit"
    res = run_draco(*credit_args(sample, out, rollouts=bad), "--reward", "outcome")
    one_line_error(res, 1, str(bad), "row 3", "field 'outcome'")
    assert not out.exists() or not any(out.glob("*.parquet"))


def test_validate_catches_non_finite_outcome(sample, tmp_path):
    bad = _rollouts_with_outcome(sample, tmp_path, math.nan)
    res = run_draco("validate", str(bad))
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err
    assert "row 3: field 'outcome': must be a finite number, got nan" in err, err
    assert "ok" not in err.split("error:")[0]


@pytest.fixture
def credit_out(sample, tmp_path):
    out = tmp_path / "credit"
    res = run_draco(*credit_args(sample, out), "--tokens", "both")
    assert res.returncode == 0, res.stderr.decode()
    return out


@pytest.mark.parametrize("column", ["advantages", "span_value"])
def test_credit_expand_refuses_non_finite(credit_out, tmp_path, column):
    ta = pl.read_parquet(credit_out / "token_advantages.parquet")
    values = ta[column].to_list()
    values[2] = list(values[2]) + [float("nan")]
    bad = tmp_path / "token_advantages.parquet"
    ta.with_columns(pl.Series(column, values, dtype=pl.List(pl.Float32))).write_parquet(bad)
    res = run_draco("credit", "expand", "--token-advantages", str(bad), "-o",
                    str(tmp_path / "dense.parquet"))
    one_line_error(res, 1, str(bad), "row 2", f"field '{column}'", "nan")
    assert not (tmp_path / "dense.parquet").exists()


@pytest.mark.parametrize("table,column", [("rewards", "advantage"), ("step_credit", "advantage"),
                                          ("rewards", "reward")])
def test_validate_catches_non_finite_credit_tables(credit_out, tmp_path, table, column):
    df = pl.read_parquet(credit_out / f"{table}.parquet")
    values = df[column].to_list()
    values[1] = float("inf")
    path = tmp_path / f"{table}.parquet"
    df.with_columns(pl.Series(column, values, dtype=pl.Float64)).write_parquet(path)
    res = run_draco("validate", str(path))
    assert res.returncode == 1
    assert f"row 1: field '{column}': must be a finite number, got inf" in res.stderr.decode()


@pytest.mark.parametrize("which,column", [("plan", "prediction"), ("labels", "return")])
def test_replay_correct_refuses_non_finite(tmp_path, which, column):
    plan = pl.DataFrame({"rollout_id": ["a", "a"], "step": [1, 2], "prediction": [0.1, 0.2],
                         "p": [1.0, 1.0], "selected": [True, True]})
    labels = pl.DataFrame({"rollout_id": ["a"] * 4, "step": [1, 1, 2, 2],
                           "side": ["realized", "resampled"] * 2,
                           "return": [1.0, 0.0, 1.0, 0.5]})
    frames = {"plan": plan, "labels": labels}
    frames[which] = frames[which].with_columns(
        pl.when(pl.int_range(pl.len()) == 1).then(float("nan")).otherwise(pl.col(column))
        .alias(column))
    for name, df in frames.items():
        df.write_parquet(tmp_path / f"{name}.parquet")
    res = run_draco("replay", "correct", "--plan", str(tmp_path / "plan.parquet"),
                    "--labels", str(tmp_path / "labels.parquet"), "-o", str(tmp_path / "c"))
    one_line_error(res, 1, f"{which}.parquet", "row 1", f"field '{column}'", "nan")


# --- 1. never silently wrong: empty inputs, groups of one ----------------------------------

EMPTY = [
    ("openai-jsonl", "empty.jsonl", "", "empty.jsonl: no rollouts in this file"),
    ("openai-jsonl", "blank.jsonl", "\n\n  \n", "blank.jsonl: no rollouts in this file"),
    ("tau-bench", "empty.json", "[]", "empty.json: no rollouts in this file"),
    ("tau2-bench", "nosims.json", '{"timestamp": "x", "tasks": []}',
     "nosims.json: field 'simulations': no simulations"),
    ("tau2-bench", "emptysims.json", '{"tasks": [], "simulations": []}',
     "emptysims.json: field 'simulations': no simulations"),
]


@pytest.mark.parametrize("fmt,name,text,message", EMPTY, ids=[c[1] for c in EMPTY])
def test_empty_inputs_are_errors(tmp_path, fmt, name, text, message):
    src = tmp_path / name
    src.write_text(text)
    res = run_draco("ingest", fmt, str(src), "--tokenizer", "approx", "-o", str(tmp_path / "o"))
    one_line_error(res, 1, message)
    assert not (tmp_path / "o" / "rollouts.parquet").exists()


def test_all_entries_rejected_is_an_error(tmp_path):
    src = write_jsonl(tmp_path / "x.jsonl", ["{broken", "[1]"])
    res = run_draco("ingest", "openai-jsonl", str(src), "--skip-invalid", "-o",
                    str(tmp_path / "o"))
    one_line_error(res, 1, "all 2 entries were rejected", "invalid JSON")


def test_groups_of_one_warn(tmp_path):
    doc = json.loads(TAU2.read_text())
    doc["simulations"] = doc["simulations"][:4]
    src = tmp_path / "t2.json"
    src.write_text(json.dumps(doc))
    res = run_draco("ingest", "tau2-bench", str(src), "-o", str(tmp_path / "o"))
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert "warning: every group has a single rollout" in err
    assert "every group advantage will be 0" in err and "--group-by" in err
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["single_rollout_groups"] == manifest["groups"] == 4


def test_groups_with_members_do_not_warn(sample, tmp_path):
    res = run_draco("ingest", "openai-jsonl", str(SAMPLE), "--step-unit", "code-block",
                    "--code-language", "python",
                    "--tokenizer", "approx", "-o", str(tmp_path / "o"))
    assert res.returncode == 0 and "warning" not in res.stderr.decode()


# --- 2. contracts validate used to miss ------------------------------------------------------


def _verdicts_citing(sample, tmp_path, steps):
    v = pl.read_parquet(sample / "verdicts.parquet")
    cited = v["cited_steps"].to_list()
    cited[5] = steps
    path = tmp_path / "verdicts.parquet"
    v.with_columns(pl.Series("cited_steps", cited, dtype=pl.List(pl.Int32))).write_parquet(path)
    return path


def test_validate_flags_citations_past_the_last_step(sample, tmp_path):
    bad = _verdicts_citing(sample, tmp_path, [1, 999])
    res = run_draco("validate", str(sample / "rollouts.parquet"), str(sample / "steps.parquet"),
                    str(bad))
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert "verdicts.parquet: row 5: field 'cited_steps': cites steps that do not exist" in err
    assert "step 999" in err


@pytest.mark.parametrize("command", ["validate", "credit"])
def test_negative_citation_refused(sample, tmp_path, command):
    bad = _verdicts_citing(sample, tmp_path, [-4])
    if command == "validate":
        res = run_draco("validate", str(bad))
        assert res.returncode == 1
        assert "row 5: field 'cited_steps': every element must be >= 1, got [-4]" in \
            res.stderr.decode()
    else:
        res = run_draco(*credit_args(sample, tmp_path / "c", verdicts=bad))
        one_line_error(res, 1, str(bad), "row 5", "field 'cited_steps'", "[-4]")


def _rollouts_with(sample, tmp_path, **columns):
    r = pl.read_parquet(sample / "rollouts.parquet")
    for name, (row, value) in columns.items():
        values = r[name].to_list()
        values[row] = value
        r = r.with_columns(pl.Series(name, values, dtype=r.schema[name]))
    path = tmp_path / "rollouts.parquet"
    r.write_parquet(path)
    return path


SPAN_CASES = [
    ("overlap", lambda sp: [sp[0], [sp[0][0] + 1, sp[0][1]]] + sp[1:],
     "spans overlap or are out of order"),
    ("reversed", lambda sp: [[sp[0][1], sp[0][0]]] + sp[1:], "span with start < 0 or end <= start"),
    ("past end", lambda sp: sp[:-1] + [[sp[-1][0], sp[-1][1] + 10_000]],
     "span ends past response_len"),
    ("triple", lambda sp: [sp[0] + [1]] + sp[1:], "a span must be a [start, end) pair"),
]


@pytest.mark.parametrize("name,mutate,message", SPAN_CASES, ids=[c[0] for c in SPAN_CASES])
def test_policy_spans_one_rule_for_validate_and_credit(sample, tmp_path, name, mutate, message):
    r = pl.read_parquet(sample / "rollouts.parquet")
    spans = r["policy_spans"][4].to_list()
    bad = _rollouts_with(sample, tmp_path, policy_spans=(4, mutate(spans)))
    val = run_draco("validate", str(bad))
    assert val.returncode == 1
    assert f"row 4: field 'policy_spans': {message}" in val.stderr.decode()
    res = run_draco(*credit_args(sample, tmp_path / "c", rollouts=bad), "--credit", "uniform")
    one_line_error(res, 1, str(bad), "row 4", "field 'policy_spans'", message)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").glob("*.parquet"))


def test_overlapping_token_spans(credit_out, tmp_path):
    ta = pl.read_parquet(credit_out / "token_advantages.parquet").drop("advantages")
    row = next(i for i, s in enumerate(ta["span_start"].to_list()) if len(s) >= 2)
    starts = ta["span_start"].to_list()
    starts[row] = [starts[row][0], starts[row][0]] + starts[row][2:]  # 2nd starts inside 1st
    bad = tmp_path / "token_advantages.parquet"
    ta.with_columns(pl.Series("span_start", starts, dtype=pl.List(pl.Int32))).write_parquet(bad)
    val = run_draco("validate", str(bad))
    assert val.returncode == 1
    assert f"row {row}: field 'span_start': token spans overlap" in val.stderr.decode()
    res = run_draco("credit", "expand", "--token-advantages", str(bad), "-o",
                    str(tmp_path / "d.parquet"))
    one_line_error(res, 1, str(bad), f"row {row}", "field 'span_start'", "overlap")


def test_repeated_static_criterion_refused(sample, tmp_path):
    rubric = tmp_path / "r.yaml"
    rubric.write_text("criteria:\n"
                      "  - {title: Pages, requirement: Reads every page.}\n"
                      "  - {title: Stops, requirement: Stops when done.}\n"
                      "  - {title: 'pages!', requirement: 'Reads every  page'}\n")
    res = run_draco("rubric", "static", "--rollouts", str(sample / "rollouts.parquet"),
                    "--rubric", str(rubric), "-o", str(tmp_path / "rb"))
    one_line_error(res, 1, "r.yaml", "criterion 2", "field 'title'", "repeats criterion 0")


def test_duplicate_group_criterion_key_in_validate(tmp_path):
    rb = pl.DataFrame({"group_id": ["g", "g"], "criterion_id": ["c1", "c1"],
                       "title": ["a", "a"], "requirement": ["r", "r"],
                       "source": ["static", "static"]})
    rb.write_parquet(tmp_path / "rubrics.parquet")
    res = run_draco("validate", str(tmp_path / "rubrics.parquet"))
    assert res.returncode == 1
    assert "row 1: field '(group_id, criterion_id)': duplicate key" in res.stderr.decode()


def test_implausible_response_len_refused_before_allocating(sample, tmp_path):
    bad = _rollouts_with(sample, tmp_path, response_len=(2, 2**31 - 1))
    res = run_draco(*credit_args(sample, tmp_path / "c", rollouts=bad), "--tokens", "dense")
    one_line_error(res, 1, str(bad), "row 2", "field 'response_len'", "implausible value 2147483647")
    val = run_draco("validate", str(bad))
    assert val.returncode == 1 and "implausible value 2147483647" in val.stderr.decode()


# --- 3. never a mixed or doubled result ----------------------------------------------------

import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402

from tests.conftest import REPO  # noqa: E402

CREDIT_TABLES = ("rewards.parquet", "step_credit.parquet", "token_advantages.parquet")


def set_ids(folder) -> set[str]:
    return {(pq.read_schema(folder / t).metadata or {}).get(b"draco.output_set", b"").decode()
            for t in CREDIT_TABLES}


def tables(folder) -> dict[str, pl.DataFrame]:
    return {t: pl.read_parquet(folder / t) for t in CREDIT_TABLES}


def same_tables(a: dict, b: dict) -> bool:
    return all(a[t].equals(b[t]) for t in CREDIT_TABLES)


def popen_draco(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "draco_cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def references(sample, tmp_path_factory):
    """The grpo and rloo outputs, each computed alone: what a whole set must equal."""
    d = tmp_path_factory.mktemp("refs")
    out = {}
    for est in ("grpo", "rloo"):
        res = run_draco(*credit_args(sample, d / est), "--estimator", est)
        assert res.returncode == 0, res.stderr.decode()
        out[est] = tables(d / est)
    return out


def test_one_output_set_id_across_every_table(sample, credit_out):
    ids = set_ids(credit_out)
    assert len(ids) == 1 and len(ids.pop()) == 32
    manifest = json.loads((sample / "manifest.json").read_text())
    for t in ("rollouts.parquet", "steps.parquet"):
        meta = pq.read_schema(sample / t).metadata
        assert meta[b"draco.output_set"].decode() == manifest["output_set"]


def test_validate_detects_a_mixed_set(sample, credit_out, tmp_path):
    other = tmp_path / "other"
    assert run_draco(*credit_args(sample, other), "--estimator", "rloo").returncode == 0
    (credit_out / "rewards.parquet").write_bytes((other / "rewards.parquet").read_bytes())
    res = run_draco("validate", str(credit_out))
    err = res.stderr.decode()
    assert res.returncode == 1 and "ok" not in err.split("error:")[0], err
    assert "rewards.parquet and step_credit.parquet come from different writes" in err, err


def test_second_writer_refuses_while_the_folder_is_locked(sample, tmp_path):
    out = tmp_path / "credit"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom draco_cli.io import folder_lock\n"
         f"with folder_lock({str(out)!r}):\n    print('locked', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "draco_cli", *credit_args(sample, out)],
                             cwd=REPO, capture_output=True,
                             env={**os.environ, "DRACO_LOCK_WAIT": "1"})
        waited = time.monotonic() - t0
        one_line_error(res, 1, str(out), "being written by another draco command",
                       f"pid {holder.pid}")
        assert waited >= 1.0
        assert not any(out.glob("*.parquet"))
    finally:
        holder.kill()
        holder.wait()
    # kill -9 of the holder released the lock: the next writer goes through
    res = run_draco(*credit_args(sample, out))
    assert res.returncode == 0, res.stderr.decode()


def test_concurrent_force_writers_leave_one_whole_set(sample, tmp_path, references):
    out = tmp_path / "credit"
    deadline = time.monotonic() + 120
    for pair in range(4):
        if time.monotonic() > deadline:
            break
        a = popen_draco(*credit_args(sample, out), "--estimator", "grpo", "--force")
        b = popen_draco(*credit_args(sample, out), "--estimator", "rloo", "--force")
        for p in (a, b):
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
        assert len(set_ids(out)) == 1
        got = tables(out)
        assert same_tables(got, references["grpo"]) or same_tables(got, references["rloo"])
        assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
            sorted(CREDIT_TABLES)
    assert pair >= 1


def test_kill_9_during_force_keeps_a_whole_set(sample, tmp_path, references):
    out = tmp_path / "credit"
    assert run_draco(*credit_args(sample, out), "--estimator", "grpo").returncode == 0
    old_ids = set_ids(out)
    t0 = time.monotonic()  # a real process's lifetime, so the kills land across all of it
    assert run_draco(*credit_args(sample, tmp_path / "timing"), "--estimator", "rloo",
                     process=True).returncode == 0
    duration = time.monotonic() - t0
    rng = random.Random(13)
    outcomes = {"old": 0, "new": 0}
    deadline = time.monotonic() + 150
    kills = 0
    while kills < 10 and time.monotonic() < deadline:
        p = popen_draco(*credit_args(sample, out), "--estimator", "rloo", "--force")
        time.sleep(rng.uniform(0.2, 1.1) * duration)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        kills += 1
        visible = sorted(x.name for x in out.iterdir() if not x.name.startswith("."))
        assert visible == sorted(CREDIT_TABLES), visible  # no orphan shown as a table
        if (out / ".draco-publish.json").exists():
            # killed between two renames: validate says so, the next writer completes it
            res = run_draco("validate", str(out))
            assert res.returncode == 1 and "publication was interrupted" in res.stderr.decode()
            from draco_cli.io import folder_lock
            from draco_cli.io.outputs import recover_folder

            with folder_lock(out):
                assert recover_folder(out)
        ids = set_ids(out)
        assert len(ids) == 1
        got = tables(out)
        if ids == old_ids:
            outcomes["old"] += 1
            assert same_tables(got, references["grpo"])
        else:
            outcomes["new"] += 1
            assert same_tables(got, references["rloo"])
            # start over from the old set, so every kill lands on a --force over older output
            assert run_draco(*credit_args(sample, out), "--estimator", "grpo", "--force") \
                .returncode == 0
            old_ids = set_ids(out)
        res = run_draco("validate", str(out))
        assert res.returncode == 0, res.stderr.decode()
    print(f"kill -9 outcomes after {kills} kills: {outcomes}")
    assert kills >= 3 and outcomes["old"] >= 1, outcomes


def test_two_rubric_writers_on_one_folder_pay_each_call_once(tmp_path, monkeypatch):
    """Real processes against the local protocol server: the second writer waits for the
    folder's lock, then answers every call from the first one's call log."""
    from tests.conftest import TAU
    from tests.llm_server import FakeLLMServer
    from tests.test_rubric_judge import KEY, scripted

    data = tmp_path / "data"
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx", "-o",
                     str(data)).returncode == 0
    server = FakeLLMServer(answer=scripted, latency=0.01).start()
    try:
        args = ("rubric", "generate", "--rollouts", str(data / "rollouts.parquet"), "--steps",
                str(data / "steps.parquet"), "-o", str(tmp_path / "rubric"), "--model",
                "openai/judge-model", "--base-url", server.url + "/v1", "--force")
        env = {"OPENAI_API_KEY": KEY, "DRACO_LOCK_WAIT": "120"}
        procs = [popen_draco(*args, env=env) for _ in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err.decode()
        assert server.hits["chat"] == 60 + 15 + 15  # one run's calls, not two
    finally:
        server.stop()
    res = run_draco("validate", str(tmp_path / "rubric"))
    assert res.returncode == 0, res.stderr.decode()


# --- 4. never a traceback ------------------------------------------------------------------

import contextlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402


@contextlib.contextmanager
def tmpfs(size: str = "4m"):
    """A real small filesystem of its own (for ENOSPC and read-only), or skip where this
    process may not mount one."""
    where = tempfile.mkdtemp(prefix="draco-fs-", dir="/tmp")
    os.chmod(where, 0o755)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                          where], capture_output=True)
    if res.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield Path(where)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", where], capture_output=True)
        subprocess.run(["umount", where], check=True)
        os.rmdir(where)


from pathlib import Path  # noqa: E402


def _old_credit_in(folder, sample):
    out = folder / "credit"
    assert run_draco(*credit_args(sample, out)).returncode == 0
    return out, snapshot(out)


def test_full_disk_keeps_the_old_output(sample):
    with tmpfs("2m") as fs:
        out, before = _old_credit_in(fs, sample)
        # fill the filesystem to the last block, as a real full disk is
        with contextlib.suppress(OSError), open(fs / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
        res = run_draco(*credit_args(sample, out), "--force", "--estimator", "rloo")
        one_line_error(res, 1, str(out), "no space left on the device")
        assert snapshot(out) == before | {k: v for k, v in snapshot(out).items()
                                          if k.startswith(".draco-write.lock")}
        assert not list(out.glob(".draco-staging-*"))


def test_read_only_folder_keeps_the_old_output(sample):
    with tmpfs() as fs:
        out, before = _old_credit_in(fs, sample)
        assert subprocess.run(["mount", "-o", "remount,ro", str(fs)]).returncode == 0
        res = run_draco(*credit_args(sample, out), "--force")
        one_line_error(res, 1, str(out), "read-only file system")
        res = run_draco("ingest", "openai-jsonl", str(SAMPLE), "--tokenizer", "approx",
                        "-o", str(fs / "new"))
        one_line_error(res, 1, str(fs / "new"), "read-only file system")
        assert snapshot(out) == before


def test_folder_without_write_permission(sample):
    """As root, permissions do not apply: run the command as nobody (setpriv), as a user is."""
    with tmpfs() as fs:
        for name in ("rollouts.parquet", "steps.parquet", "verdicts.parquet"):
            shutil.copy(sample / name, fs / name)
        (fs / "out").mkdir(mode=0o755)
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] \
            if os.geteuid() == 0 else []
        if not prefix:
            os.chmod(fs / "out", 0o555)
        res = subprocess.run([*prefix, sys.executable, "-m", "draco_cli",
                              *credit_args(fs, fs / "out")], capture_output=True, cwd=REPO)
        one_line_error(res, 1, str(fs / "out"), "permission denied")
        res = subprocess.run([*prefix, sys.executable, "-m", "draco_cli",
                              *credit_args(fs, fs / "out" / "sub")], capture_output=True, cwd=REPO)
        one_line_error(res, 1, str(fs / "out" / "sub"), "permission denied")


def test_output_option_that_is_a_file(sample, tmp_path):
    f = tmp_path / "afile"
    f.write_text("keep me")
    res = run_draco(*credit_args(sample, f))
    one_line_error(res, 2, f"-o {f}: is a file, expected a folder")
    res = run_draco("ingest", "openai-jsonl", str(SAMPLE), "--tokenizer", "approx", "-o", str(f))
    one_line_error(res, 2, f"-o {f}: is a file, expected a folder")
    res = run_draco(*credit_args(sample, f / "sub" / "dir"))
    one_line_error(res, 2, f"-o {f / 'sub' / 'dir'}: {f} is a file, not a folder")
    assert f.read_text() == "keep me"


def test_file_output_that_is_a_folder(credit_out, tmp_path):
    res = run_draco("credit", "expand", "--token-advantages",
                    str(credit_out / "token_advantages.parquet"), "-o", str(tmp_path), "--force")
    one_line_error(res, 2, f"{tmp_path}: is a folder, expected a file name")


@pytest.mark.parametrize("kind", ["binary", "folder", "latin1"])
def test_rubric_file_that_is_not_text(sample, tmp_path, kind):
    path = tmp_path / "rubric.yaml"
    if kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "latin1":
        path.write_bytes("criteria:\n  - {title: Caf\xe9, requirement: x}\n".encode("latin-1"))
    else:
        path.mkdir()
    res = run_draco("rubric", "static", "--rollouts", str(sample / "rollouts.parquet"),
                    "--rubric", str(path), "-o", str(tmp_path / "rb"))
    one_line_error(res, 1, str(path), {"binary": "not UTF-8", "latin1": "not UTF-8",
                                       "folder": "is a folder"}[kind])


DEEP = 100_000


@pytest.mark.parametrize("fmt,where", [("openai-jsonl", "line 1"), ("tau-bench", "entry 0"),
                                       ("tau2-bench", "simulations[0]")])
def test_deeply_nested_json(tmp_path, fmt, where):
    nest = "[" * DEEP + "]" * DEEP
    text = {"openai-jsonl": '{"task_id": "t", "messages": ' + nest + "}\n",
            "tau-bench": "[" + nest + "]",
            "tau2-bench": '{"tasks": [], "simulations": [' + nest + "]}"}[fmt]
    src = tmp_path / "deep.json"
    src.write_text(text)
    res = run_draco("ingest", fmt, str(src), "--tokenizer", "approx", "-o", str(tmp_path / "o"))
    one_line_error(res, 1, "deep.json", where, "nested too deeply")


def test_audit_overlap_given_the_wrong_table(sample, tmp_path):
    res = run_draco("audit", "overlap", "--own", str(sample / "steps.parquet"), "--reference",
                    str(sample / "steps.parquet"), "-o", str(tmp_path / "a"))
    one_line_error(res, 1, "steps.parquet", "field 'title'", "--level group compares rubrics")


# --- 5. secrets ----------------------------------------------------------------------------

from draco_cli.redact import MASK, Redactor, redact  # noqa: E402

AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ."
       "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c")
# (text with a planted secret, the secret itself, what must survive around it)
PLANTED = [
    ("{'password': 'hunter2-dict'}", "hunter2-dict", "{'password': '"),
    ('{"password":"hunter2-json"}', "hunter2-json", '{"password":"'),
    ('{"password": "hunter 2 spaced"}', "hunter 2 spaced", '"password": "'),
    ('password = "hunter2-assign"', "hunter2-assign", 'password = "'),
    ("DB_PASSWORD=hunter2-env\nHOST=x", "hunter2-env", "HOST=x"),
    ("login?user=a&password=hunter2-url&next=/", "hunter2-url", "&next=/"),
    ("the password: hunter2-prose", "hunter2-prose", "the password: "),
    ("passwd=hunter2-passwd", "hunter2-passwd", "passwd="),
    ("token github_pat_11ABCDEFG0123456789_abcdefghijABCDEFGHIJ0123456789abcdefghijKLMNOP end",
     "github_pat_11ABCDEFG0123456789_abcdefghij", "end"),
    ("ghp_" + "a1B2" * 9, "ghp_" + "a1B2" * 9, ""),
    (f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET, "aws_secret_access_key = "),
    (f'{{"SecretAccessKey": "{AWS_SECRET}"}}', AWS_SECRET, '"SecretAccessKey": "'),
    ("id AKIAIOSFODNN7EXAMPLE ok", "AKIAIOSFODNN7EXAMPLE", " ok"),
    ("maps key=AIzaSyDdI0hCZtE6vySjMm-WEfRq3CPzqKqqsHI;", "AIzaSyDdI0hCZtE6vySjMm-WEfRq3CPzqKqqsHI",
     ";"),
    (f"cookie {JWT} done", JWT, " done"),
    ("Authorization: Bearer abcdef123456789xyz", "abcdef123456789xyz", "Authorization: Bearer "),
    ("key sk-proj-abcdefghijklmnop1234", "sk-proj-abcdefghijklmnop1234", "key "),
    ("xoxb-123456789012-abcdefghij", "xoxb-123456789012-abcdefghij", ""),
]


@pytest.mark.parametrize("text,secret,kept", PLANTED, ids=[p[1][:16] for p in PLANTED])
def test_default_redaction_masks_planted_secrets(text, secret, kept):
    r = Redactor()
    out = r(text)
    assert secret not in out and MASK in out and kept in out, out
    assert r.count >= 1 and redact(text) == out


@pytest.mark.parametrize("text", [
    "passwordless login works", "the password is strong", "n_tokens = 5",
    "the passenger from Asia booked flight HAT001", "ask the user for their secret question",
    "ghp_short", "Bearer of bad news", "eyJ alone", "sk-short",
])
def test_default_redaction_leaves_ordinary_text(text):
    assert Redactor()(text) == text


def test_user_patterns_keep_their_groups_and_defaults_can_be_off():
    r = Redactor([r"(id)-(\d+)-\2"], defaults=False)
    assert r("id-42-42 password=x") == f"{MASK} password=x"
    res = run_draco("rubric", "generate", "--rollouts", str(SAMPLE), "--steps", str(SAMPLE),
                    "-o", "z", "--model", "openai/m", "--redact", "(")
    one_line_error(res, 2, "--redact: not a regular expression")


def test_planted_secrets_never_reach_the_provider_or_the_call_log(tmp_path, chat_row,
                                                                 monkeypatch):
    """Real CLI, real SDK, local server: every planted secret is masked before it leaves."""
    from tests.llm_server import FakeLLMServer
    from tests.test_rubric_judge import KEY, scripted

    rows = []
    for i, (text, _, _) in enumerate(PLANTED):
        row = chat_row(rollout_id=f"r{i}", task_id=f"t{i % 3}")
        row["messages"][1]["content"] = f"do it; {text}"
        row["messages"][3]["content"] = text  # a tool result echoing the secret
        row["messages"][4]["content"] = f"done, used {text}"
        rows.append(row)
    src = write_jsonl(tmp_path / "x.jsonl", rows)
    assert run_draco("ingest", "openai-jsonl", str(src), "-o", str(tmp_path / "d")).returncode == 0
    server = FakeLLMServer(answer=scripted).start()
    try:
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        res = run_draco("rubric", "generate", "--rollouts",
                        str(tmp_path / "d" / "rollouts.parquet"), "--steps",
                        str(tmp_path / "d" / "steps.parquet"), "-o", str(tmp_path / "rb"),
                        "--model", "openai/judge-model", "--base-url", server.url + "/v1")
        assert res.returncode == 0, res.stderr.decode()
        sent = json.dumps(server.bodies)
    finally:
        server.stop()
    assert MASK in sent
    written = b"".join(p.read_bytes() for p in (tmp_path / "rb").rglob("*") if p.is_file())
    for _, secret, _ in PLANTED:
        assert secret not in sent, secret
        assert secret.encode() not in written, secret


def test_report_masks_secrets_in_the_rollout_it_shows(tmp_path):
    from tests.test_report import SAMPLE as RUN_ARGS

    data = tmp_path / "data"
    data.mkdir()
    for name in ("rollouts.parquet", "steps.parquet"):
        shutil.copy(REPO / "sample_data" / "appworld_mini" / name, data / name)
    args = [a.replace("sample_data/appworld_mini", str(data)) for a in RUN_ARGS]
    res = run_draco("run", *args, "-o", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr.decode()
    rewards = pl.read_parquet(tmp_path / "run" / "credit" / "rewards.parquet")
    rid = rewards.filter(pl.col("credit_mode") == "step")["rollout_id"][0]
    steps = pl.read_parquet(data / "steps.parquet")
    steps = steps.with_columns(
        pl.when((pl.col("rollout_id") == rid) & (pl.col("step") == 1))
        .then(pl.lit(f"login(password='hunter2-report', token='{JWT}')"))
        .otherwise(pl.col("action")).alias("action"))
    steps.write_parquet(data / "steps.parquet")
    res = run_draco("report", str(tmp_path / "run"), "--rollout", rid, "-o",
                    str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr.decode()
    html_text = (tmp_path / "r.html").read_text()
    assert "hunter2-report" not in html_text and JWT not in html_text
    assert "password=&#x27;[REDACTED]" in html_text


# --- 6. validate a whole run folder ---------------------------------------------------------


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    from tests.test_report import SAMPLE as RUN_ARGS

    d = tmp_path_factory.mktemp("runs")
    res = run_draco("run", *RUN_ARGS, "--train-step", "0", "-o", str(d))
    assert res.returncode == 0, res.stderr.decode()
    return d


def _copy_run(run_folder, tmp_path):
    dst = tmp_path / "runs"
    shutil.copytree(run_folder, dst)
    return dst


def no_ok(err: str) -> None:
    assert not any(line.startswith("ok") for line in err.splitlines()), err


def test_validate_a_whole_run_folder(run_folder):
    res = run_draco("validate", str(run_folder), "sample_data/appworld_mini")
    err = res.stderr.decode()
    assert res.returncode == 0, err
    for part in ("step-0/credit: 12 rewards, 48 step_credit, 12 token_advantages",
                 "step-0/judge: ", "llm_calls", "step-0/rubric: ", "10 rubrics",
                 "appworld_mini: 12 rollouts, 48 steps", "step-0: 12 rollouts, 48 steps"):
        assert part in err, (part, err)


def test_run_folder_verdicts_checked_against_the_runs_inputs(run_folder, tmp_path):
    runs = _copy_run(run_folder, tmp_path)
    v = runs / "step-0" / "judge" / "verdicts.parquet"
    df = pl.read_parquet(v)
    cited = df["cited_steps"].to_list()
    cited[0] = [999]
    meta = pq.read_schema(v).metadata
    table = df.with_columns(pl.Series("cited_steps", cited, dtype=pl.List(pl.Int32))).to_arrow()
    pq.write_table(table.replace_schema_metadata(meta), v)  # same set id: only the citation is bad
    res = run_draco("validate", str(runs))
    err = res.stderr.decode()
    assert res.returncode == 1, err
    no_ok(err)
    assert "judge/verdicts.parquet: row 0: field 'cited_steps': cites steps that do not exist" in err


def test_corrupt_manifest_is_reported(run_folder, tmp_path):
    runs = _copy_run(run_folder, tmp_path)
    (runs / "step-0" / "manifest.json").write_text('{"stages": {"rubric": ')
    res = run_draco("validate", str(runs))
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err
    no_ok(err)
    assert "step-0/manifest.json: not valid JSON" in err


def test_run_manifest_row_counts_are_checked(run_folder, tmp_path):
    runs = _copy_run(run_folder, tmp_path)
    r = runs / "step-0" / "credit" / "rewards.parquet"
    meta = pq.read_schema(r).metadata
    pq.write_table(pq.read_table(r).slice(0, 5).replace_schema_metadata(meta), r)
    res = run_draco("validate", str(runs))
    err = res.stderr.decode()
    assert res.returncode == 1
    assert "field 'rows': says 12 rows for credit/rewards.parquet, the file has 5" in err


def test_several_folders_one_bad_means_no_ok(run_folder, tmp_path, sample):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = run_draco("validate", str(run_folder), str(sample), str(empty))
    err = res.stderr.decode()
    assert res.returncode == 1
    no_ok(err)
    assert f"{empty}: no draco tables in this folder or below it" in err


def test_ingest_manifest_checked_against_its_tables(sample, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(sample, d)
    m = json.loads((d / "manifest.json").read_text())
    m["rollouts"] = 99
    (d / "manifest.json").write_text(json.dumps(m))
    res = run_draco("validate", str(d))
    assert res.returncode == 1
    assert "manifest.json: field 'rollouts': says 99 rows, rollouts.parquet has 12" in \
        res.stderr.decode()


def test_full_disk_under_an_llm_stage(tmp_path):
    """SQLite's own 'database or disk is full' comes out as one line too."""
    from tests.conftest import TAU
    from tests.llm_server import FakeLLMServer
    from tests.test_rubric_judge import KEY, scripted

    with tmpfs("3m") as fs:
        d = fs / "d"
        assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx", "-o",
                         str(d)).returncode == 0
        with contextlib.suppress(OSError), open(fs / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
        server = FakeLLMServer(answer=scripted).start()
        try:
            res = subprocess.run(
                [sys.executable, "-m", "draco_cli", "rubric", "generate", "--rollouts",
                 str(d / "rollouts.parquet"), "--steps", str(d / "steps.parquet"), "-o",
                 str(fs / "rb"), "--model", "openai/m", "--base-url", server.url + "/v1"],
                capture_output=True, cwd=REPO, env={**os.environ, "OPENAI_API_KEY": KEY})
        finally:
            server.stop()
        line = one_line_error(res, 1)
        assert "disk is full" in line or "no space left" in line, line
        assert server.hits["chat"] == 0


def test_two_ingests_into_one_new_folder_publish_once(tmp_path):
    """Without --force, two concurrent writers never both publish: the second re-checks under
    the folder's lock and refuses."""
    for attempt in range(3):
        out = tmp_path / f"o{attempt}"
        args = ("ingest", "openai-jsonl", str(SAMPLE), "--tokenizer", "approx", "-o", str(out))
        procs = [popen_draco(*args) for _ in range(2)]
        results = [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 1], results
        err = next(e for code, e in results if code == 1)
        assert "already exists; pass --force to overwrite it" in err and "Traceback" not in err
        res = run_draco("validate", str(out))
        assert res.returncode == 0, res.stderr.decode()


def test_a_misspelled_tokenizer_names_the_option_and_its_choices(tmp_path):
    res = run_draco("ingest", "openai-jsonl", str(SAMPLE), "--tokenizer", "aprox",
                    "-o", str(tmp_path / "o"))
    one_line_error(res, 1, "aprox", "--tokenizer", "approx")


def test_verdicts_without_a_verdict_column_are_refused_not_scored_as_unanswered(sample,
                                                                               tmp_path):
    # every verdict would read as unanswered: no criterion kept, every advantage 0, exit 0
    bad = tmp_path / "verdicts.parquet"
    pl.read_parquet(sample / "verdicts.parquet").drop("verdict").write_parquet(bad)
    res = run_draco(*credit_args(sample, tmp_path / "out", verdicts=bad))
    one_line_error(res, 1, str(bad), "field 'verdict'", "missing required column")
    assert not (tmp_path / "out").exists()
    res = run_draco("validate", "--table", "verdicts", str(bad))
    assert res.returncode == 1 and b"field 'verdict': missing required column" in res.stderr


def test_credit_compute_with_no_learning_signal_exits_1_unless_allowed(sample, tmp_path):
    flat = tmp_path / "verdicts.parquet"   # every member passes every criterion: all dropped
    pl.read_parquet(sample / "verdicts.parquet").with_columns(
        pl.lit("pass").alias("verdict")).write_parquet(flat)
    res = run_draco(*credit_args(sample, tmp_path / "a", verdicts=flat))
    assert res.returncode == 1, res.stderr
    assert b"no learning signal: every one of the 12 criteria was dropped" in res.stderr, res.stderr
    assert (tmp_path / "a" / "token_advantages.parquet").exists()   # the tables, whole
    res = run_draco(*credit_args(sample, tmp_path / "b", verdicts=flat), "--allow-no-signal")
    assert res.returncode == 0 and b"no learning signal" not in res.stderr
    assert run_draco(*credit_args(sample, tmp_path / "c")).returncode == 0   # mixed verdicts
