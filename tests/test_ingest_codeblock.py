"""The code-block unit counts the blocks the harness ran (issue 31): on mini-swe-agent logs
one ```bash block per reply, never a ```python block quoted in the thought, a fence inside a
here-document or a quoted script, or the blocks of a reply answered by a format error."""

from __future__ import annotations

import json

import polars as pl
import pytest

from draco_cli.errors import InputError
from draco_cli.ingest import ingest
from draco_cli.ingest.codeblocks import CodeRule, executed_blocks, fenced_blocks
from tests.conftest import SAMPLE, run_draco
from tests.mini_swe_agent import trajectory


@pytest.fixture
def swe_log(tmp_path):
    path = tmp_path / "mini.jsonl"
    rows = [trajectory(f"csvlite__csvlite-{k}", trial, trial == 0)
            for k in range(2) for trial in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def test_steps_are_the_executed_bash_blocks(swe_log, tmp_path):
    path, rows = swe_log
    ingest("openai-jsonl", [path], tmp_path / "o", step_unit="code-block", tokenizer="approx")
    steps = pl.read_parquet(tmp_path / "o" / "steps.parquet")
    assert steps.height == sum(r["executed"] for r in rows) == 16
    per = steps.group_by("rollout_id").len()
    assert per["len"].to_list() == [4] * 4
    one = steps.filter(pl.col("rollout_id") == rows[0]["rollout_id"]).sort("step")
    actions = one["action"].to_list()
    assert all(a.startswith("```bash\n") and a.endswith("\n```") for a in actions)
    # the here-document and the quoted script are whole: their inner fences are text
    assert "python reproduce.py" in actions[1] and "```python" in actions[1]
    assert actions[2].rstrip("`").rstrip().endswith("&& python reproduce.py")
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in actions[3]
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["code_language"] == "bash" and manifest["code_blocks"] == "one"
    assert manifest["code_blocks_not_run"] == {"bash": 8, "markdown": 4, "python": 4}


def test_every_block_of_any_language_when_asked(swe_log, tmp_path):
    path, rows = swe_log
    ingest("openai-jsonl", [path], tmp_path / "o", step_unit="code-block", tokenizer="approx",
           code_language="any", code_blocks="all")
    steps = pl.read_parquet(tmp_path / "o" / "steps.parquet")
    # per trajectory: python+bash, bash, bash+bash, bash, markdown+bash
    assert steps.height == 8 * len(rows)


def test_wrong_language_is_an_error_not_silent_no_action(tmp_path):
    with pytest.raises(InputError, match=r"--code-language.*python: 48"):
        ingest("openai-jsonl", [SAMPLE], tmp_path / "o", step_unit="code-block",
               tokenizer="approx")
    res = run_draco("ingest", "openai-jsonl", SAMPLE, "--step-unit", "code-block",
                    "--tokenizer", "approx", "-o", tmp_path / "p")
    assert res.returncode == 1 and b"--code-language" in res.stderr
    assert b"Traceback" not in res.stderr
    res = run_draco("ingest", "openai-jsonl", SAMPLE, "--step-unit", "code-block",
                    "--code-language", "python", "--tokenizer", "approx", "-o", tmp_path / "q")
    assert res.returncode == 0, res.stderr
    assert pl.read_parquet(tmp_path / "q" / "steps.parquet").height == 48


def test_bad_code_options_are_usage_errors(tmp_path):
    res = run_draco("ingest", "openai-jsonl", SAMPLE, "--step-unit", "code-block",
                    "--code-language", " , ", "--tokenizer", "approx", "-o", tmp_path / "o")
    assert res.returncode == 2 and b"--code-language" in res.stderr


def test_fence_reading():
    text = ("```bash\ncat <<EOF > a.md\n```\nEOF\n```\n"       # heredoc holding a bare fence
            "```sh\necho 'x\n```\ny'\n```\n"                    # quote spanning a fence line
            "```bash\necho it's\n```\n"                         # unpaired quote: plain close
            "````\n```python\nnested\n```\n````\n"              # longer fence holds shorter
            "```python\nnever closed\n")
    blocks = fenced_blocks(text)
    assert [b.language for b in blocks] == ["bash", "sh", "bash", ""]
    assert [text[b.start:b.end].count("\n") for b in blocks] == [4, 4, 2, 4]
    assert executed_blocks(text, CodeRule(frozenset({"bash"}), "one")) == []
    assert len(executed_blocks(text, CodeRule(frozenset({"bash", "sh"}), "all"))) == 3
