"""The merge stage alone on another run's candidate pool (``rubric generate --stages merge
--candidates RUN``): the DRACO paper's merge replay (Figure 9c)."""

from __future__ import annotations

import json

import polars as pl
import pytest

from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.test_run import SAMPLE_RA, SAMPLE_SA, draco


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def test_merge_alone_on_another_runs_candidates(server, tmp_path):
    base = ["--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
            "--base-url", server.url + "/v1"]
    assert draco("rubric", "generate", *base, "-o", tmp_path / "a").returncode == 0
    before = dict(server.hits)
    n_bodies = len(server.bodies)
    res = draco("rubric", "generate", *base, "--stages", "merge", "--candidates",
                tmp_path / "a", "-o", tmp_path / "b")
    assert res.returncode == 0, res.stderr
    groups = pl.read_parquet(SAMPLE_RA)["group_id"].n_unique()
    new = server.bodies[n_bodies:]
    assert len(new) == groups and sum(server.hits.values()) - sum(before.values()) == groups
    assert all("curate the final" in json.dumps(b) for b in new)    # merge calls only
    pool = pl.read_parquet(tmp_path / "a" / "rubric_candidates.parquet")
    assert pl.read_parquet(tmp_path / "b" / "rubric_candidates.parquet").sort(
        "candidate_id").equals(pool.sort("candidate_id"))
    assert pl.read_parquet(tmp_path / "b" / "rubrics.parquet")["group_id"].n_unique() == groups
    res = draco("rubric", "generate", *base, "--candidates", tmp_path / "a", "-o", tmp_path / "c")
    assert res.returncode == 2 and "pass --stages merge" in res.stderr
    res = draco("rubric", "generate", *base, "--stages", "merge", "--candidates",
                tmp_path / "nowhere", "-o", tmp_path / "d")
    assert res.returncode in (1, 2) and "rubric_candidates.parquet" in res.stderr
