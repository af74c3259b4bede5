"""draco sql: every table of every run folder as DuckDB views, across training steps; tables
piped on stdin; and the docs' query examples, run as written."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import shlex
import sqlite3
import subprocess
import sys

import polars as pl
import pytest

from tests.conftest import REPO, TAU, run_draco, sample_step

SAMPLE = ["--rollouts", "sample_data/appworld_mini/rollouts.parquet", "--steps",
          "sample_data/appworld_mini/steps.parquet", "--model",
          "replay/sample_data/llm_calls.sqlite"]
VIEWS = {"rollouts", "steps", "rubrics", "rubric_candidates", "verdicts", "verdicts_raw",
         "rewards", "step_credit", "token_advantages", "calls"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sql")
    for n in (0, 1):
        res = run_draco("run", *sample_step(n, d / "in"), *SAMPLE[4:], "--train-step", str(n),
                        "-o", str(d / "runs"))
        assert res.returncode == 0, res.stderr.decode()
    return d / "runs"


def sql(*args, input=None):
    res = run_draco("sql", *args, "--json", input=input)
    assert res.returncode == 0, res.stderr.decode()
    return json.loads(res.stdout)


def test_every_table_is_a_view_across_steps(runs):
    s0, s1 = str(runs / "step-0"), str(runs / "step-1")
    views = {r["name"] for r in sql(s0, s1, ".tables")}
    assert views >= VIEWS
    for name in VIEWS - {"calls"}:
        rel = {"rollouts": "sample_data/appworld_mini/rollouts.parquet",
               "steps": "sample_data/appworld_mini/steps.parquet"}.get(name)
        one = pl.read_parquet(REPO / rel) if rel else pl.read_parquet(
            next((runs / "step-0").rglob(f"{name}.parquet")))
        got = sql(s0, s1, f"SELECT train_step, count(*) AS n FROM {name} GROUP BY 1 ORDER BY 1")
        assert got == [{"train_step": 0, "n": one.height}, {"train_step": 1, "n": one.height}]
    conn = sqlite3.connect(runs / "step-1" / "llm_calls.sqlite")
    logged = conn.execute("SELECT count(*), sum(cost_usd) FROM calls").fetchone()[0]
    conn.close()
    got = sql(s0, s1, "SELECT run, count(*) AS n FROM calls WHERE train_step = 1 GROUP BY 1")
    assert got == [{"run": s1, "n": logged}]
    # a folder of run folders stands for them all
    assert sql(str(runs), "SELECT train_step, count(*) AS n FROM rewards GROUP BY 1 ORDER BY 1") \
        == [{"train_step": 0, "n": 12}, {"train_step": 1, "n": 12}]
    # the rollouts' own train_step is replaced by the folder's: step 1's rows say 1
    rows = sql(s1, "SELECT DISTINCT train_step FROM rollouts")
    assert rows == [{"train_step": 1}]
    # a cross-step aggregate: mean reward per step equals polars' over each folder's file
    got = sql(s0, s1, "SELECT train_step, avg(reward) AS r FROM rewards GROUP BY 1 ORDER BY 1")
    want = pl.read_parquet(runs / "step-1" / "credit" / "rewards.parquet")["reward"].mean()
    assert got[1]["r"] == pytest.approx(want)


def test_formats_errors_and_sql_from_a_pipe(runs):
    s0 = str(runs / "step-0")
    res = run_draco("sql", s0, "SELECT verdict, count(*) AS n FROM verdicts GROUP BY 1 "
                    "ORDER BY 1", "--format", "csv")
    assert res.returncode == 0 and res.stdout.decode().splitlines()[0] == "verdict,n"
    piped = run_draco("sql", s0, "--format", "json",
                      input=b"SELECT count(*) AS n FROM rubrics;")
    assert json.loads(piped.stdout) == [{"n": pl.read_parquet(
        runs / "step-0" / "rubric" / "rubrics.parquet").height}]
    bad = run_draco("sql", s0, "SELEC 1")
    assert bad.returncode == 2 and bad.stderr.decode().startswith("error: SQL: Parser Error")
    assert len(bad.stderr.decode().strip().splitlines()) == 1
    missing = run_draco("sql", s0, "SELECT * FROM nope")
    assert missing.returncode == 2 and b"nope" in missing.stderr and b"Traceback" not in \
        missing.stderr
    direct = sql("-c", "SELECT count(*) AS n FROM 'sample_data/appworld_mini/rollouts.parquet'")
    assert direct == [{"n": 12}]


def test_tables_piped_on_stdin(runs, tmp_path):
    v = pl.read_parquet(runs / "step-0" / "judge" / "verdicts.parquet")
    want = v.group_by("verdict").len().sort("verdict").rename({"len": "n"}).to_dicts()
    query = "SELECT verdict, count(*) AS n FROM verdicts GROUP BY 1 ORDER BY 1"
    parquet = io.BytesIO()
    v.write_parquet(parquet)
    stream = io.BytesIO()
    v.write_ipc_stream(stream)
    arrow_file = io.BytesIO()
    v.write_ipc(arrow_file)
    for data in (parquet.getvalue(), stream.getvalue(), arrow_file.getvalue()):
        assert sql("-", "--table", "verdicts", query, input=data) == want
    # draco's own stream output chains in: credit expand -o - | validate reads it back
    garbage = run_draco("sql", "-", "--table", "verdicts", query, input=b"not a table")
    assert garbage.returncode == 1 and b"<stdin: verdicts>: neither Parquet nor" in \
        garbage.stderr
    # a stream draco did not write is named with --table for validate
    assert run_draco("validate", "-", input=stream.getvalue()).returncode == 1
    named = run_draco("validate", "-", "--table", "verdicts", input=stream.getvalue())
    assert named.returncode == 0 and f"{v.height} verdicts".encode() in named.stderr
    # the name is that call's: the next one in the same process is not told it
    assert run_draco("validate", "-", input=stream.getvalue()).returncode == 1
    wrong = run_draco("validate", "-", "--table", "nope", input=stream.getvalue())
    assert wrong.returncode == 2 and b"'nope': choose " in wrong.stderr \
        and b"rewards, rollouts" in wrong.stderr
    # other commands reading - take Parquet too
    r = pl.read_parquet(REPO / "sample_data" / "appworld_mini" / "rollouts.parquet")
    buf = io.BytesIO()
    r.write_parquet(buf)
    res = run_draco("eval", "--rollouts", "-", "--json", input=buf.getvalue())
    assert res.returncode == 0 and json.loads(res.stdout)["n_rollouts"] == 12


def _on_terminal(args, stdin_tty: bool, feed: bytes = b""):
    """Run draco with a pseudo-terminal as stdout (or stdin)."""
    master, slave = pty.openpty()
    kw = {"stdin": slave, "stdout": subprocess.PIPE} if stdin_tty else \
        {"stdout": slave, "stdin": subprocess.DEVNULL}
    proc = subprocess.Popen([sys.executable, "-m", "draco_cli", *args], cwd=REPO,
                            stderr=subprocess.PIPE, **kw)
    os.close(slave)
    if feed:
        os.write(master, feed)
    out = b""
    try:
        while not stdin_tty:
            chunk = os.read(master, 4096)
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    if stdin_tty:
        out, err = proc.communicate(timeout=60)
    else:
        err = proc.stderr.read()
        proc.wait(timeout=60)
    os.close(master)
    return proc.returncode, out, err


def test_binary_to_a_terminal_and_dash_as_a_folder_are_refused(runs, tmp_path):
    ta = runs / "step-0" / "credit" / "token_advantages.parquet"
    code, out, err = _on_terminal(["credit", "expand", "--token-advantages", str(ta), "-o", "-"],
                                  stdin_tty=False)
    assert code == 2 and b"stdout is a terminal" in err and b"\x00" not in out
    for args in (["ingest", "openai-jsonl", "sample_data/appworld_mini.jsonl", "--step-unit",
                  "code-block", "--code-language", "python", "--tokenizer", "approx", "-o", "-"],
                 ["run", *SAMPLE, "-o", "-"]):
        res = run_draco(*args)
        assert res.returncode == 2 and b"cannot hold a folder" in res.stderr, args
    assert not (REPO / "-").exists()


def test_interactive_shell(runs):
    code, out, err = _on_terminal(
        ["sql", str(runs / "step-0"), str(runs / "step-1")], stdin_tty=True,
        feed=b".tables\nSELECT train_step, count(*) AS n\nFROM rewards GROUP BY 1 ORDER BY 1;\n"
             b"SELEC oops;\n.quit\n")
    text = out.decode(errors="replace")
    assert code == 0, err.decode()
    assert "token_advantages" in text and re.search(r"\b1\s+12\b", text), text
    assert b"Parser Error" in err  # an error in the shell does not end it


def _examples() -> list[str]:
    """Shell lines in README.md and docs/*.md code blocks that query with SQL."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if path.name == "cli.md":
            continue
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for cmd in block.replace("\\\n", " ").splitlines():
                if "duckdb" in cmd or "draco sql" in cmd:
                    found.append(cmd.strip())
    return found


def test_docs_query_examples_run_as_written(runs, tmp_path):
    """Every SQL example of the docs, in a folder laid out as the docs lay it out."""
    examples = _examples()
    assert len(examples) >= 6 and any("duckdb" in e for e in examples)
    (tmp_path / "runs").mkdir()
    for n in (0, 1):
        os.symlink(runs / f"step-{n}", tmp_path / "runs" / f"step-{n}")
    os.symlink(REPO / "sample_data", tmp_path / "sample_data")
    for args in (["tau-bench", str(TAU), "--tokenizer", "approx", "-o", "runs/tau"],
                 ["openai-jsonl", "sample_data/appworld_mini.jsonl", "--step-unit",
                  "code-block",
                  "--code-language", "python", "--tokenizer", "approx", "-o", "runs/sample"]):
        assert run_draco("ingest", *args, cwd=tmp_path).returncode == 0
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    for cmd in examples:
        res = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, env=env,
                             timeout=300)
        assert res.returncode == 0, f"{cmd}\n{res.stderr.decode()[-1500:]}"
        assert res.stdout.strip(), cmd
        assert shlex.split(cmd)  # well-formed shell
