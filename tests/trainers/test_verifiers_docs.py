"""docs/trainers.md, section "verifiers and prime-rl": every ```python verifiers block runs
(its own fence, so tests/trainers/test_docs.py's count of the other sections stays theirs)."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import numpy as np
import pytest

vf = pytest.importorskip("verifiers.v1")

from verifiers.v1.utils.trace_store import write_episode  # noqa: E402

from draco_cli.inloop import StepScorer  # noqa: E402
from draco_cli.trainers.loader import AlignmentError  # noqa: E402
from tests.conftest import run_draco  # noqa: E402
from tests.llm_server import FakeLLMServer  # noqa: E402
from tests.test_rubric_judge import scripted  # noqa: E402
from tests.trainers import prime_rl_contract as contract  # noqa: E402
from tests.trainers.verifiers_traces import make_group  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"
SECTION = DOC.read_text().split("## verifiers and prime-rl")[1].split("\n## ")[0]
BLOCKS = re.findall(r"```python verifiers\n(.*?)```", SECTION, re.DOTALL)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted, latency=0.01).start()
    yield s
    s.stop()


def block(word: str) -> str:
    found = [b for b in BLOCKS if word in b]
    assert len(found) == 1, word
    return found[0]


def test_three_blocks():
    assert len(BLOCKS) == 3


def test_reading_the_export_back(server, tmp_path, capsys):
    rng = np.random.default_rng(21)
    records = tmp_path / "rec"
    records.mkdir()
    for ep in make_group(rng, 1, 4):
        write_episode(records, ep)
    assert run_draco("ingest", "verifiers", records / "traces.jsonl", "-o",
                     tmp_path / "in").returncode == 0
    write_episode(records, make_group(rng, 2, 1)[0])
    assert run_draco("run", "--rollouts", tmp_path / "in" / "rollouts.parquet", "--steps",
                     tmp_path / "in" / "steps.parquet", "--model", "openai/m", "--base-url",
                     server.url + "/v1", "-o", tmp_path / "run").returncode == 0
    (tmp_path / "scored").mkdir()
    assert run_draco("export", "--to", "verifiers", "--advantages", tmp_path / "run",
                     "--records", records / "traces.jsonl", "-o",
                     tmp_path / "scored" / "traces.jsonl").returncode == 0
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(block("read_episodes"), {})
    finally:
        os.chdir(old)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and sum(line.endswith("unassigned") for line in lines) == 1


def test_in_loop_helper(server, tmp_path):
    ns: dict = {}
    exec(block("fill_trace"), ns)
    rng = np.random.default_rng(22)
    traces = [ep.traces[0] for ep in make_group(rng, 1, 4)]

    async def run() -> None:
        async with StepScorer("openai/m", base_url=server.url + "/v1", group_size=4,
                              decode=str, call_log=tmp_path / "c.sqlite") as scorer:
            await ns["credit"]("g1", traces, scorer, 3)

    asyncio.run(run())
    for t in traces:
        assert all((n.advantages is not None) == any(n.mask) for n in t.nodes)
    with pytest.raises(AlignmentError):
        ns["fill_trace"](traces[0], traces[1].id, np.zeros(3))


def test_prime_rl_registration(monkeypatch):
    algo = contract.install(monkeypatch)

    class Tokenizer:
        def decode(self, ids: list[int]) -> str:
            return str(ids)

    exec(block("register("), {"tokenizer": Tokenizer()})
    assert algo.ALGORITHM_CLASSES["grpo"].__name__ == "DracoAlgorithm"
