"""``draco run --engine ray`` on a local Ray cluster of two worker processes: the union of the
partitions equals the local engine's tables, a rerun pays nothing, an unreachable cluster is a
one-line error. Skipped when the ray extra is not installed."""

from __future__ import annotations

import json

import polars as pl
import pytest

from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.test_run import SAMPLE_RA, SAMPLE_SA, calls_in, draco, paid_twice

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

TABLES = ["rubric/rubric_candidates.parquet", "rubric/rubrics.parquet",
          "judge/verdicts_raw.parquet", "judge/verdicts.parquet", "credit/rewards.parquet",
          "credit/step_credit.parquet", "credit/token_advantages.parquet"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-ray-0000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def run(server, out, *extra):
    return draco("run", "--rollouts", SAMPLE_RA, "--steps", SAMPLE_SA, "--model", "openai/m",
                 "--base-url", server.url + "/v1", "-o", out, *extra)


def test_ray_engine_equals_local_and_reruns_free(cluster, server, tmp_path):
    assert run(server, tmp_path / "local").returncode == 0
    res = run(server, tmp_path / "ray", "--engine", "ray", "--partitions", "2")
    assert res.returncode == 0, res.stderr
    for t in TABLES:
        assert pl.read_parquet(tmp_path / "ray" / t).equals(
            pl.read_parquet(tmp_path / "local" / t)), t
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["status"] == "done"
    assert sorted(p.name for p in (tmp_path / "ray" / "ray").iterdir()) == ["part-0", "part-1"]
    log = tmp_path / "ray" / "llm_calls.sqlite"
    assert calls_in(log) == 30 and paid_twice(log) == 0    # every partition's calls, merged once
    hits = sum(server.hits.values())
    res = run(server, tmp_path / "ray", "--engine", "ray", "--partitions", "2", "--redo",
              "rubric")
    assert res.returncode == 0, res.stderr
    assert sum(server.hits.values()) == hits and calls_in(log) == 30


def test_unreachable_cluster_is_one_line(server, tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    res = run(server, tmp_path / "r", "--engine", "ray", "--ray-address", "127.0.0.1:1")
    assert res.returncode == 2 and "cannot reach the Ray cluster" in res.stderr
    assert not (tmp_path / "r" / "rubric" / "rubrics.parquet").exists()
