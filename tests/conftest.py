from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
import os

SHARED_DATA = Path(os.environ.get("DRACO_SHARED_DATA", REPO.parent / "shared" / "data"))
TAU = SHARED_DATA / "tau-bench" / "gpt-4o-airline-15tasks.json"
TAU2 = SHARED_DATA / "tau2-bench" / "gpt-4.1-airline-1trial.json"
TAU2_FT = SHARED_DATA / "tau2-bench" / "ft-gpt-4.1-sft-airline-1trial.json"
SAMPLE = REPO / "sample_data" / "appworld_mini.jsonl"


def pytest_configure(config):
    # The real logs are part of the test contract: CI lays ../shared/data beside the checkout.
    missing = [p for p in (TAU, TAU2, TAU2_FT) if not p.exists()]
    if missing:
        raise pytest.UsageError(f"real test data missing: {missing} (expected ../shared/data)")


def run_draco(*args: str, input: bytes | None = None, cwd: Path | None = None):
    """Run the real CLI in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "draco_cli", *args],
        input=input,
        capture_output=True,
        cwd=cwd or REPO,
    )


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def chat_row():
    """A minimal valid openai-jsonl rollout with token counts."""

    def make(**over):
        row = {
            "rollout_id": "r1",
            "task_id": "t1",
            "outcome": 1.0,
            "messages": [
                {"role": "system", "content": "sys", "n_tokens": 3},
                {"role": "user", "content": "do it", "n_tokens": 4},
                {"role": "assistant", "content": None, "n_tokens": 10,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42", "n_tokens": 5},
                {"role": "assistant", "content": "done", "n_tokens": 2},
            ],
        }
        row.update(over)
        return row

    return make
