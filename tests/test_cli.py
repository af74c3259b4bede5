"""The real command line: exit codes, messages, pipes. Its entry point in-process (``run_draco``)
except where the process is the point: ``python -m draco_cli`` itself, a binary pipe from
another process, DRACO_DEBUG's traceback."""

from __future__ import annotations

import json
import sys

import polars as pl

from tests.conftest import REPO, SAMPLE, TAU, run_draco


def test_version_and_help():
    res = run_draco("--version", process=True)
    assert res.returncode == 0 and res.stdout.decode().strip() == "0.1.0"
    res = run_draco("--help", process=True)
    assert res.returncode == 0
    for cmd in ("ingest", "validate", "schema"):
        assert cmd in res.stdout.decode()


def test_every_command_has_help_with_an_example():
    for args in (["ingest"], ["validate"], ["schema", "export"], ["judge", "filter"],
                 ["llm", "export"], ["llm", "check"], ["rubric", "generate"],
                 ["rubric", "static"], ["judge", "score"], ["audit", "self-judge"],
                 ["audit", "overlap"], ["audit", "rubric"], ["audit", "cost"], ["eval"],
                 ["replay", "plan"], ["replay", "correct"], ["replay", "fit"],
                 ["replay", "evolve"], ["replay", "exact-check"], ["run"], ["report"],
                 ["credit", "compute"], ["credit", "expand"]):
        res = run_draco(*args, "--help")
        assert res.returncode == 0, args
        assert "Example: draco " in res.stdout.decode(), args


def test_no_command_is_usage_error():
    assert run_draco(process=True).returncode == 2
    # a group without its command: the group's help, once (typer's rich help prints itself)
    res = run_draco("judge", process=True)
    assert res.returncode == 2 and res.stdout.decode().count("Usage:") == 1
    assert "Judging rollouts against rubrics" in res.stdout.decode()


def test_usage_errors_exit_2():
    res = run_draco("ingest", "nope-format", "x", "-o", "y")
    assert res.returncode == 2
    res = run_draco("ingest", "tau-bench", str(TAU), "-o", "y", "--step-unit", "paragraph")
    assert res.returncode == 2


def test_a_usage_error_is_one_line_and_no_help():
    """Typer's rich help prints as it is formatted: a usage error once printed the command's
    whole help on stdout before its one line."""
    for args in (("judge", "score", "--rollouts", "nope.parquet"), ("run", "--samples", "x"),
                 ("credit", "compute", "--nope")):
        res = run_draco(*args)
        assert res.returncode == 2, args
        assert res.stdout == b"", (args, res.stdout[:200])
        assert len(res.stderr.decode().strip().splitlines()) == 1, res.stderr


def test_ingest_sample_and_validate(tmp_path):
    out = tmp_path / "sample"
    res = run_draco("ingest", "openai-jsonl", str(SAMPLE), "--step-unit", "code-block",
                    "--code-language", "python",
                    "--tokenizer", "approx", "-o", str(out))
    assert res.returncode == 0, res.stderr.decode()
    err = res.stderr.decode()
    assert "12 rollouts in 3 groups" in err and "approximate" in err
    assert res.stdout == b""  # data to stdout only; messages to stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["step_unit"] == "code-block"
    assert manifest["terminations"] == {"max_turns": 1, "no_action": 1, "submitted": 10}
    res = run_draco("validate", str(out))
    assert res.returncode == 0 and "12 rollouts, 48 steps" in res.stderr.decode()


def test_ingest_offers_every_format_the_library_reads():
    from typing import get_args

    from draco_cli.choices import IngestFormat
    from draco_cli.ingest import FORMATS, RECORD_FORMATS

    assert set(get_args(IngestFormat)) == set(FORMATS) | set(RECORD_FORMATS)


def test_ingest_refuses_a_bad_group_by_or_step_before_reading(tmp_path):
    """For the log formats and the record formats alike, before any file is read or made."""
    import pytest

    from draco_cli import UsageError, ingest_logs

    for fmt in ("tau-bench", "rllm"):
        with pytest.raises(UsageError, match="--group-by 'x': choose among"):
            ingest_logs(fmt, [tmp_path / "missing.json"], tmp_path / "out",
                        group_by="trial,x")
        with pytest.raises(UsageError, match=r"--train-step -1: must be ≥ 0"):
            ingest_logs(fmt, [tmp_path / "missing.json"], tmp_path / "out", train_step=-1)
    # the keywords the Python API has always taken
    out = tmp_path / "kw"
    result = ingest_logs("tau-bench", [TAU], out=out, tokenizer="approx", group_by="task_id")
    assert result.rollouts > 0 and (out / "rollouts.parquet").exists()
    res = run_draco("ingest", "tau-bench", str(TAU), "--group-by", "task_id,nope",
                    "-o", str(tmp_path / "out"))
    assert res.returncode == 2 and "--group-by 'nope'" in res.stderr.decode()
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_without_force(tmp_path):
    args = ["ingest", "tau-bench", str(TAU), "--tokenizer", "approx", "-o", str(tmp_path)]
    assert run_draco(*args).returncode == 0
    before = (tmp_path / "rollouts.parquet").read_bytes()
    res = run_draco(*args)
    assert res.returncode == 1
    assert "rollouts.parquet already exists; pass --force" in res.stderr.decode()
    assert (tmp_path / "rollouts.parquet").read_bytes() == before
    assert run_draco(*args, "--force").returncode == 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_pipe_roundtrip_through_validate(tmp_path):
    """A table written as an Arrow IPC stream on stdout is read back from stdin."""
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(tmp_path)).returncode == 0
    code = (
        "import polars as pl, sys; from draco_cli.io import write_table; "
        "from draco_cli.schemas import Step; "
        f"write_table(pl.read_parquet({str(tmp_path / 'steps.parquet')!r}), '-', Step)"
    )
    import subprocess

    stream = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=REPO).stdout
    res = run_draco("validate", "-", input=stream)
    assert res.returncode == 0, res.stderr.decode()
    assert "789 steps" in res.stderr.decode()
    # and the stream itself round-trips exactly
    import pyarrow.ipc as ipc

    back = pl.from_arrow(ipc.open_stream(stream).read_all())
    assert back.equals(pl.read_parquet(tmp_path / "steps.parquet"))


def test_validate_reports_problems_with_exit_1(tmp_path):
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(tmp_path)).returncode == 0
    steps = pl.read_parquet(tmp_path / "steps.parquet")
    steps = steps.with_columns(
        pl.when((pl.col("rollout_id") == "0-0") & (pl.col("step") == 3)).then(99)
        .otherwise(pl.col("step")).alias("step")
    )
    steps.write_parquet(tmp_path / "steps.parquet")
    res = run_draco("validate", str(tmp_path))
    assert res.returncode == 1
    err = res.stderr.decode()
    assert "steps.parquet: row 2: field 'step': steps of a rollout must run 1, 2, 3" in err


def test_debug_env_shows_traceback(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "DRACO_DEBUG": "1"}
    res = subprocess.run([sys.executable, "-m", "draco_cli", "validate", str(tmp_path / "x.parquet")],
                         capture_output=True, env=env, cwd=REPO)
    assert res.returncode == 1 and b"Traceback" in res.stderr


def test_cli_reference_is_current_and_every_command_has_help_and_example():
    import typer

    from draco_cli.cli import app
    from tests.cli_reference import _commands, render

    missing = [f"{name}: no help" if not (cmd.help or "").strip() else f"{name}: no example"
               for name, cmd in _commands(typer.main.get_command(app))
               if "Example: draco " not in (cmd.help or "")]
    assert missing == []
    on_disk = (REPO / "docs" / "cli.md").read_text()
    assert on_disk == render(), "docs/cli.md is stale: python -m tests.cli_reference"


def _doc_option_uses(text: str) -> list[tuple[list[str], str]]:
    """(command words, option) for every `draco <command> … --option` the text shows, a
    shell line continued with a backslash read as one line."""
    import re

    uses = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        for m in re.finditer(r"(?:^|[`\s$(])draco ((?:[a-z][a-z-]*\s+){0,2})([^`\n|;&)]*)", line):
            words = m.group(1).split()
            uses += [(words, o) for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)",
                                                    " ".join(words) + " " + m.group(2))]
    return uses


def test_every_option_the_docs_show_exists():
    from draco_cli.cli import command

    unknown, checked = [], 0
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if doc.name == "decisions.md":   # records options as they were
            continue
        for words, option in _doc_option_uses(doc.read_text(encoding="utf-8")):
            cmd = command()
            for w in words:
                if w not in getattr(cmd, "commands", {}):
                    break
                cmd = cmd.commands[w]
            if hasattr(cmd, "commands") or option == "--help":
                continue
            checked += 1
            if not any(option in p.opts + p.secondary_opts for p in cmd.params):
                unknown.append(f"{doc.name}: draco {' '.join(words)} {option}")
    assert checked > 200 and unknown == []


def test_ctrl_c_in_any_command_says_so(monkeypatch, tmp_path):
    """typer turns Ctrl-C into exit code 130 before draco's handler sees it: the one line
    must come all the same (it came for `draco run` alone)."""
    import draco_cli.cli.schema as schema_cli

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(schema_cli, "render_json_schemas", interrupted)
    res = run_draco("schema", "export", str(tmp_path / "s"))
    assert res.returncode == 130
    assert res.stderr.decode().strip() == \
        "error: interrupted (nothing was published; rerun to resume)"
