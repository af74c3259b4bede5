"""Results on stdout, messages on stderr, --format table|json|csv on every reporting command,
and audits that pair their inputs properly or refuse clearly."""

from __future__ import annotations

import csv
import io
import json
import math

import polars as pl
import pytest

from draco_cli.cli.output import Report, clean, emit, pick_format
from tests.conftest import run_draco, sample_step

SAMPLE = ["--rollouts", "sample_data/appworld_mini/rollouts.parquet", "--steps",
          "sample_data/appworld_mini/steps.parquet", "--model",
          "replay/sample_data/llm_calls.sqlite"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two training steps of the sample, and one run without a train step."""
    d = tmp_path_factory.mktemp("runs")
    for n in (0, 1):
        res = run_draco("run", *sample_step(n, d / "in"), *SAMPLE[4:], "--train-step", str(n),
                        "-o", str(d / "steps"))
        assert res.returncode == 0, res.stderr.decode()
    assert run_draco("run", *SAMPLE, "-o", str(d / "plain")).returncode == 0
    return d


def test_emit_formats(capsys):
    df = pl.DataFrame({"scope": ["a", "b"], "value": [0.5, float("nan")],
                       "cites": [[1, 2], []]})
    report = Report([("figures", df)], lines=["total 2"])
    emit(report, "json")
    doc = json.loads(capsys.readouterr().out)  # strict JSON: NaN became null
    assert doc == {"figures": [{"scope": "a", "value": 0.5, "cites": [1, 2]},
                               {"scope": "b", "value": None, "cites": []}]}
    emit(report, "csv")
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == {"scope": "a", "value": "0.5", "cites": "[1, 2]"}
    emit(report, "table")
    text = capsys.readouterr().out
    assert "figures" in text and "total 2" in text and "0.5" in text
    assert clean({1: math.inf, "x": (1.0, math.nan)}) == {"1": None, "x": [1.0, None]}
    assert pick_format(None, True) == "json" and pick_format(None, False) == "table"


def test_eval_results_on_stdout_in_each_format(runs):
    args = ["eval", "--rollouts", str(runs / "steps" / "step-0"), "--k", "1,2"]
    table = run_draco(*args)
    assert table.returncode == 0, table.stderr.decode()
    assert b"pass^2" in table.stdout and b"pass^2" not in table.stderr
    as_csv = run_draco(*args, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout.decode())))
    assert {"scope", "metric", "k", "value", "n"} == set(rows[0])
    as_json = json.loads(run_draco(*args, "--format", "json").stdout)
    alias = json.loads(run_draco(*args, "--json").stdout)
    assert as_json == alias and as_json["n_rollouts"] == 12
    tgc = [r for r in rows if r["metric"] == "tgc" and r["scope"] == "overall"][0]
    assert float(tgc["value"]) == pytest.approx(as_json["tgc"])
    clash = run_draco(*args, "--json", "--format", "csv")
    assert clash.returncode == 2 and b"--json conflicts with --format csv" in clash.stderr


def test_audit_cost_and_credit_formats(runs):
    s0, s1 = runs / "steps" / "step-0", runs / "steps" / "step-1"
    res = run_draco("audit", "cost", "--calls", str(s0), "--calls", str(s1), "-o",
                    str(runs / "cost"), "--format", "json")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert [r["train_step"] for r in doc["per_step"]] == [0, 1]
    assert sum(r["calls"] for r in doc["per_phase"]) == sum(r["calls"] for r in doc["per_step"])
    res = run_draco("credit", "compute", "--rollouts", SAMPLE[1], "--steps", SAMPLE[3],
                    "--verdicts", str(s0 / "judge" / "verdicts.parquet"), "-o",
                    str(runs / "credit"), "--json")
    assert res.returncode == 0, res.stderr.decode()
    stats = json.loads(res.stdout)
    assert stats["rollouts"] == 12 and sum(stats["credit_modes"].values()) == 12


def test_audit_cost_keeps_a_run_without_train_step_as_its_own_row(runs):
    res = run_draco("audit", "cost", "--calls", str(runs / "steps" / "step-0"), "--calls",
                    str(runs / "plain"), "-o", str(runs / "cost2"), "--json")
    assert res.returncode == 0, res.stderr.decode()
    steps = [r["train_step"] for r in json.loads(res.stdout)["per_step"]]
    assert steps == [0, None]  # never silently dropped


def test_self_judge_pairs_run_folders_by_train_step(runs):
    s0, s1 = runs / "steps" / "step-0", runs / "steps" / "step-1"
    # the same verdicts as self and reference: agreement 1 whatever order the pairs come in
    res = run_draco("audit", "self-judge", "--self", str(s0), "--self", str(s1),
                    "--reference", str(s1), "--reference", str(s0), "-o", str(runs / "sj"),
                    "--json")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["overall"]["agreement"] == 1.0 and doc["overall"]["unanswered_rate"] == 0.0
    assert {r["scope"] for r in doc["scopes"]} >= {"step:0", "step:1"}
    files = run_draco("audit", "self-judge", "--self", str(s0 / "judge" / "verdicts.parquet"),
                      "--reference", str(s0 / "judge" / "verdicts.parquet"), "-o",
                      str(runs / "sj2"), "--json")
    assert json.loads(files.stdout)["overall"]["agreement"] == 1.0


@pytest.mark.parametrize("pair, words", [
    (("step-0", "step-1"), b"compare two judges on the same step"),
    (("step-0", "step-0/judge/verdicts.parquet"), b"pair run folders with run folders"),
])
def test_self_judge_refuses_mismatched_pairs(runs, pair, words):
    a, b = (runs / "steps" / p for p in pair)
    res = run_draco("audit", "self-judge", "--self", str(a), "--reference", str(b), "-o",
                    str(runs / "bad"))
    assert res.returncode == 2 and words in res.stderr, res.stderr.decode()
    assert b"Traceback" not in res.stderr and not (runs / "bad").exists()


def test_self_judge_refuses_verdicts_with_nothing_in_common(runs, tmp_path):
    v = pl.read_parquet(runs / "steps" / "step-0" / "judge" / "verdicts.parquet")
    v.with_columns(pl.col("rollout_id") + "-other").write_parquet(tmp_path / "other.parquet")
    res = run_draco("audit", "self-judge", "--self", str(tmp_path / "other.parquet"),
                    "--reference", str(runs / "steps" / "step-0" / "judge" / "verdicts.parquet"),
                    "-o", str(tmp_path / "a"))
    assert res.returncode == 1 and b"share no (rollout_id, criterion_id)" in res.stderr


def _commands():
    import typer

    from draco_cli.cli import app
    from tests.cli_reference import _commands as walk

    return list(walk(typer.main.get_command(app)))


def test_every_option_says_what_it_does_and_flags_show_no_type():
    missing = [f"{name} {p.opts[0]}" for name, cmd in _commands() for p in cmd.params
               if p.name != "help" and not (getattr(p, "help", None) or "").strip()]
    assert missing == []
    shown = {f"{name} {p.opts[-1]}": p.display_type_rich(None) for name, cmd in _commands()
             for p in cmd.params if p.name != "help"}
    assert shown["draco run --setting"] == "<draco|no-credit|static|static-no-credit|outcome>"
    assert shown["draco run --thinking"] == "<on|off>"
    assert shown["draco eval --format"] == "<table|json|csv>"
    assert shown["draco audit overlap --matcher"] == "<lexical|embedding|llm>"
    assert [k for k, v in shown.items() if v == "<bool>"] == []
    for args in (["run"], ["eval"], ["audit", "cost"]):
        res = run_draco(*args, "-h")
        # typer's own --help shows its type; none of draco's flags does
        assert res.returncode == 0 and res.stdout.decode().count("<bool>") == 1


@pytest.mark.parametrize("args", [
    ["eval", "--bogus"], ["eval", "--k", "x", "--rollouts", "r"], ["audit", "cost"],
    ["run", "--setting", "nope", "--rollouts", "r", "--steps", "s", "--model", "m", "-o", "o"],
    ["eval", "--rollouts", "does-not-exist.parquet"],
])
def test_one_error_style(args):
    res = run_draco(*args)
    err = res.stderr.decode()
    assert res.returncode in (1, 2) and err.startswith("error: "), err
    assert len(err.strip().splitlines()) == 1 and "╭" not in err and "Traceback" not in err


def test_run_summary_as_json_and_csv_on_stdout(runs):
    """draco run --format json: the run's results as one document on stdout (a rerun, so every
    stage is reused), progress lines still on stderr; csv: one row of the scalar fields."""
    res = run_draco("run", *SAMPLE, "--train-step", "0", "-o", str(runs / "steps"),
                    "--format", "json")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["status"] == "done" and doc["train_step"] == 0 and doc["rollouts"] == 12
    assert doc["criteria_kept"] + doc["criteria_dropped"] == 10 and doc["healthy"] is True
    assert doc["skipped"] == ["rubric", "judge", "credit"]
    assert doc["token_advantages"].endswith("token_advantages.parquet")
    assert b"skipped" in res.stderr
    rows = list(csv.DictReader(io.StringIO(run_draco(
        "run", *SAMPLE, "--train-step", "0", "-o", str(runs / "steps"),
        "--format", "csv").stdout.decode())))
    assert len(rows) == 1 and rows[0]["rollouts"] == "12" and rows[0]["status"] == "done"
