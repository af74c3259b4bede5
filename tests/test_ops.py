"""The operations layer (issue 14) and its output sets (issue 13): every audit, eval and
single-file command publishes one locked set with one id, checked against its contract; a
kill -9 leaves the old set or the new one, never a mix; two writers leave one whole set."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from draco_cli.io import write_table
from draco_cli.schemas import VerdictAggregated
from tests.conftest import REPO, run_draco

MINI = REPO / "sample_data" / "appworld_mini"
ROLLOUTS = MINI / "rollouts.parquet"
STEPS = MINI / "steps.parquet"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real draco run of the sample, answered from its recorded call log."""
    d = tmp_path_factory.mktemp("ops") / "run"
    res = run_draco("run", "--rollouts", str(ROLLOUTS), "--steps", str(STEPS), "--model",
                    "replay/sample_data/llm_calls.sqlite", "-o", str(d))
    assert res.returncode == 0, res.stderr.decode()
    return d


@pytest.fixture(scope="module")
def constant_verdicts(run, tmp_path_factory) -> Path:
    """The run's verdicts with one (group, criterion) failed by every member: a criterion the
    constant filter drops and the all-pass filter keeps."""
    v = pl.read_parquet(run / "judge" / "verdicts.parquet")
    r = pl.read_parquet(ROLLOUTS).select("rollout_id", "group_id")
    v = v.join(r, on="rollout_id")
    kept = v.group_by("group_id", "criterion_id").agg((pl.col("verdict") == "fail").any()
                                                       .alias("f")).filter(pl.col("f"))
    g, c = kept.sort("group_id", "criterion_id").row(0)[:2]
    hit = (pl.col("group_id") == g) & (pl.col("criterion_id") == c)
    v = v.with_columns(pl.when(hit).then(pl.lit("fail")).otherwise(pl.col("verdict"))
                       .alias("verdict")).drop("group_id")
    path = tmp_path_factory.mktemp("constant") / "verdicts.parquet"
    write_table(v, path, VerdictAggregated)
    return path


def set_ids(folder: Path, names: list[str]) -> set[str]:
    return {(pq.read_schema(folder / n).metadata or {}).get(b"draco.output_set", b"").decode()
            for n in names}


def tables(folder: Path, names: list[str]) -> dict[str, pl.DataFrame]:
    return {n: pl.read_parquet(folder / n) for n in names}


def same(a: dict, b: dict) -> bool:
    return all(a[n].equals(b[n]) for n in a)


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draco_cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# Each command, with two argument sets whose outputs differ ("a", "b"), writing `names` into
# the folder `out` (single-file commands write one name into it).
def commands(run: Path, constant: Path) -> dict[str, tuple]:
    rubrics = str(run / "rubric" / "rubrics.parquet")
    verdicts = str(run / "judge" / "verdicts.parquet")
    ta = str(run / "credit" / "token_advantages.parquet")
    return {
        "audit rubric": (
            lambda out: ["audit", "rubric", "--rubrics", rubrics, "--rollouts", str(ROLLOUTS),
                         "-o", str(out), "--verdicts"],
            [verdicts], [str(constant)], ["rubric_criteria.parquet", "rubric_summary.parquet"]),
        "audit cost": (
            lambda out: ["audit", "cost", "--rollouts", str(ROLLOUTS), "-o", str(out),
                         "--calls"],
            [str(run)], [str(REPO / "sample_data" / "llm_calls.sqlite"), "--steps", str(STEPS)],
            ["cost_category.parquet", "cost_naive.parquet", "cost_phase.parquet",
             "cost_step.parquet"]),
        "audit self-judge": (
            lambda out: ["audit", "self-judge", "--reference", verdicts, "--rollouts",
                         str(ROLLOUTS), "-o", str(out), "--self"],
            [verdicts], [str(constant)], ["agreement.parquet", "tests.parquet"]),
        "judge filter": (
            lambda out: ["judge", "filter", "--rollouts", str(ROLLOUTS), "--verdicts",
                         str(constant), "-o", str(out / "filtered.parquet"), "--drop"],
            ["all-pass"], ["constant"], ["filtered.parquet"]),
        "credit expand": (
            lambda out: ["credit", "expand", "--token-advantages", ta,
                         "-o", str(out / "ta.parquet"), "--to"],
            ["dense"], ["both"], ["ta.parquet"]),
        "eval": (
            lambda out: ["eval", "-o", str(out), "--rollouts", str(run), "--k"],
            ["1"], ["1,2"], ["metrics.parquet"]),
    }


@pytest.fixture(scope="module")
def references(run, constant_verdicts, tmp_path_factory):
    """Each command's two outputs, each written alone: what a whole set must equal."""
    out = {}
    for name, (base, a, b, names) in commands(run, constant_verdicts).items():
        refs = {}
        for which, extra in (("a", a), ("b", b)):
            d = tmp_path_factory.mktemp("ref")
            res = run_draco(*base(d), *extra)
            assert res.returncode == 0, (name, res.stderr.decode())
            refs[which] = tables(d, names)
        if name != "audit cost":  # the category table is the same; the per-step table differs
            assert not same(refs["a"], refs["b"]), name
        out[name] = refs
    return out


COMMANDS = ["audit rubric", "audit cost", "audit self-judge", "judge filter", "credit expand",
            "eval"]


@pytest.mark.parametrize("name", COMMANDS)
def test_one_set_id_and_validate_ok(run, constant_verdicts, references, tmp_path, name):
    base, a, _, names = commands(run, constant_verdicts)[name]
    res = run_draco(*base(tmp_path), *a)
    assert res.returncode == 0, res.stderr.decode()
    ids = set_ids(tmp_path, names)
    assert len(ids) == 1 and len(ids.pop()) == 32
    assert visible(tmp_path) == sorted(names)
    assert same(tables(tmp_path, names), references[name]["a"])
    res = run_draco("validate", str(tmp_path))
    assert res.returncode == 0, res.stderr.decode()
    # the second write without --force is refused and leaves the first whole
    before = {n: (tmp_path / n).read_bytes() for n in names}
    res = run_draco(*base(tmp_path), *a)
    assert res.returncode == 1 and "pass --force" in res.stderr.decode()
    assert before == {n: (tmp_path / n).read_bytes() for n in names}


@pytest.mark.parametrize("name", COMMANDS)
def test_concurrent_force_writers_leave_one_whole_set(run, constant_verdicts, references,
                                                      tmp_path, name):
    base, a, b, names = commands(run, constant_verdicts)[name]
    deadline = time.monotonic() + 60
    pairs = 0
    while pairs < 2 and time.monotonic() < deadline:
        procs = [popen(*base(tmp_path), *a, "--force"), popen(*base(tmp_path), *b, "--force")]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
        pairs += 1
        assert len(set_ids(tmp_path, names)) == 1
        got = tables(tmp_path, names)
        assert same(got, references[name]["a"]) or same(got, references[name]["b"])
        assert visible(tmp_path) == sorted(names)
    assert pairs >= 1


@pytest.mark.parametrize("name", ["audit rubric", "judge filter", "eval"])
def test_kill_9_leaves_the_old_set_or_the_new_one(run, constant_verdicts, references, tmp_path,
                                                  name):
    """kill -9 at random moments of a --force over an older output: the folder shows the old
    set whole or the new one whole (a publication cut between two renames is completed by the
    next writer, and validate says so meanwhile)."""
    base, a, b, names = commands(run, constant_verdicts)[name]
    assert run_draco(*base(tmp_path), *a).returncode == 0
    old = set_ids(tmp_path, names)
    t0 = time.monotonic()  # a real process's lifetime, so the kills land across all of it
    assert run_draco(*base(tmp_path / "timing"), *b, process=True).returncode == 0
    duration = time.monotonic() - t0
    rng = random.Random(14)
    outcomes = {"old": 0, "new": 0}
    kills = 0
    deadline = time.monotonic() + 90
    while kills < 5 and time.monotonic() < deadline:
        p = popen(*base(tmp_path), *b, "--force")
        time.sleep(rng.uniform(0.3, 1.1) * duration)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        kills += 1
        assert visible(tmp_path) == sorted(names + ["timing"])
        if (tmp_path / ".draco-publish.json").exists():
            res = run_draco("validate", str(tmp_path))
            assert res.returncode == 1 and "publication was interrupted" in res.stderr.decode()
            from draco_cli.io import folder_lock
            from draco_cli.io.outputs import recover_folder

            with folder_lock(tmp_path):
                assert recover_folder(tmp_path)
        ids = set_ids(tmp_path, names)
        assert len(ids) == 1
        got = tables(tmp_path, names)
        if ids == old:
            outcomes["old"] += 1
            assert same(got, references[name]["a"])
        else:
            outcomes["new"] += 1
            assert same(got, references[name]["b"])
            assert run_draco(*base(tmp_path), *a, "--force").returncode == 0
            old = set_ids(tmp_path, names)
    print(f"{name}: kill -9 outcomes after {kills} kills: {outcomes}")
    assert kills >= 3 and outcomes["old"] >= 1, outcomes


def test_audit_judge_narrows_like_credit_judge(run, constant_verdicts, tmp_path):
    """--judge means one thing everywhere: several judges without it, or a label the file does
    not hold, is a usage error naming the option (not a mixed or empty audit)."""
    v = pl.concat([pl.read_parquet(run / "judge" / "verdicts.parquet"),
                   pl.read_parquet(constant_verdicts).with_columns(pl.lit("other").alias("judge"))],
                  how="diagonal_relaxed")
    both = tmp_path / "both.parquet"
    write_table(v, both, VerdictAggregated)
    audit = ["audit", "rubric", "--rubrics", str(run / "rubric" / "rubrics.parquet"),
             "--verdicts", str(both), "-o"]
    credit = ["credit", "compute", "--rollouts", str(ROLLOUTS), "--steps", str(STEPS),
              "--verdicts", str(both), "-o"]
    for cmd in (audit, credit):
        res = run_draco(*cmd, str(tmp_path / "x"))
        err = res.stderr.decode()
        assert res.returncode == 2 and "several judges (judge, other)" in err, err
        assert "choose one with --judge" in err
        res = run_draco(*cmd, str(tmp_path / "x"), "--judge", "nobody")
        err = res.stderr.decode()
        assert res.returncode == 2 and "--judge 'nobody'" in err and "has judges judge, other" \
            in err, err
        res = run_draco(*cmd, str(tmp_path / cmd[0]), "--judge", "other")
        assert res.returncode == 0, res.stderr.decode()
    # the audit of one judge picked from the mixed file equals the audit of its own file
    res = run_draco("audit", "rubric", "--rubrics", str(run / "rubric" / "rubrics.parquet"),
                    "--verdicts", str(constant_verdicts), "-o", str(tmp_path / "alone"))
    assert res.returncode == 0, res.stderr.decode()
    for t in ("rubric_summary.parquet", "rubric_criteria.parquet"):
        assert pl.read_parquet(tmp_path / "audit" / t).equals(
            pl.read_parquet(tmp_path / "alone" / t))
    # self-judge names its own options
    res = run_draco("audit", "self-judge", "--self", str(both), "--reference",
                    str(constant_verdicts), "-o", str(tmp_path / "sj"), "--self-judge", "x")
    assert res.returncode == 2 and "--self-judge 'x'" in res.stderr.decode()


def test_report_shows_the_criteria_the_run_kept(run, constant_verdicts, tmp_path):
    """The report's kept/dropped counts are those of the run's own filter (its --drop), not a
    filter rerun with default settings."""
    import shutil

    counts = {}
    for drop in ("all-pass", "constant"):
        d = tmp_path / drop
        shutil.copytree(run, d)
        args = ["run", "--rollouts", str(ROLLOUTS), "--steps", str(STEPS), "--model",
                "replay/sample_data/llm_calls.sqlite", "--drop", drop, "-o", str(d)]
        # the judge's verdicts replaced: the judge stage is reused, credit redone on them
        write_table(pl.read_parquet(constant_verdicts), d / "judge" / "verdicts.parquet",
                    VerdictAggregated, force=True)
        res = run_draco(*args)
        assert res.returncode == 0, res.stderr.decode()
        stats = json.loads((d / "manifest.json").read_text())["stages"]["credit"]["stats"]
        res = run_draco("report", str(d), "-o", str(d / "report.html"))
        assert res.returncode == 0, res.stderr.decode()
        text = (d / "report.html").read_text()
        assert (f"<p>{stats['criteria_kept']} criteria kept, {stats['criteria_dropped']} "
                "dropped") in text
        counts[drop] = stats["criteria_kept"]
    assert counts["constant"] == counts["all-pass"] - 1


def test_llm_settings_checked_once_where_made():
    from draco_cli.errors import UsageError
    from draco_cli.llm.settings import LLMSettings

    s = LLMSettings("openai/m", base_url=["http://a/v1"], thinking=True)
    assert s.base_url == "http://a/v1" and s.thinking is True
    assert LLMSettings("openai/m", base_url=["http://a/v1", "http://b/v1"]).base_url == (
        "http://a/v1", "http://b/v1")
    with pytest.raises(UsageError, match="--structured-output nope"):
        LLMSettings("openai/m", structured_output="nope")


def test_option_groups_declare_each_option_once():
    """The LLM, prompt, judge and rubric options of every command come from one group each:
    the same flags, defaults and help in run, judge score and rubric generate."""
    import typer

    from draco_cli.cli import app

    root = typer.main.get_command(app)
    cmds = {"run": root.commands["run"], "score": root.commands["judge"].commands["score"],
            "generate": root.commands["rubric"].commands["generate"]}
    seen = {}
    for name, cmd in cmds.items():
        for p in cmd.params:
            if p.name in ("model", "help", "out", "rollouts", "steps"):
                continue
            seen.setdefault(p.name, set()).add((tuple(p.opts), repr(p.default), p.help))
    for option in ("base_url", "concurrency", "max_tokens", "redact", "samples",
                   "max_criteria", "call_log", "adapt"):
        assert len(seen[option]) == 1, (option, seen[option])


@pytest.mark.parametrize("command, panels", [
    (["run"], ["LLM options", "Prompt options", "Rubric options", "Judge options",
               "Credit options"]),
    (["judge", "score"], ["LLM options", "Prompt options", "Judge options"]),
    (["rubric", "generate"], ["LLM options", "Prompt options", "Rubric options"]),
    (["credit", "compute"], ["Credit options"]),
])
def test_one_option_group_per_option_object(command, panels):
    from typer.testing import CliRunner

    from draco_cli.cli import app

    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for panel in panels:
        assert f"─ {panel} ─" in res.output, (panel, res.output)
