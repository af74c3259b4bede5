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


def test_worker_killed_mid_run_resumes(cluster, monkeypatch, tmp_path):
    """A worker running a partition is killed (SIGKILL) after it made some calls: Ray runs the
    partition again (or, past its retries, the run fails in one line and a rerun resumes), the
    partition answers from its own call log, so the run ends with the local engine's tables and
    no answered call paid twice."""
    import os
    import signal
    import threading

    from tests.test_run import wait_for

    def busy_workers() -> list[int]:
        """Our cluster's worker processes running a task (their title is ray::<task>,
        ray::IDLE when idle): descendants of this process only, not another run's."""
        parent, title = {}, {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = open(f"/proc/{d}/stat").read()
                    parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
                    title[int(d)] = open(f"/proc/{d}/cmdline").read().replace("\0", " ")
                except (OSError, IndexError, ValueError):
                    continue
        mine, todo = set(), [os.getpid()]
        while todo:
            p = todo.pop()
            kids = [c for c, pp in parent.items() if pp == p and c not in mine]
            mine.update(kids)
            todo += kids
        return [p for p in mine if title.get(p, "").startswith("ray::")
                and "MapBatches" in title[p]]

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-ray-0000000000000")
    fast = FakeLLMServer(answer=scripted).start()
    slow = FakeLLMServer(answer=scripted, latency=0.4).start()
    killed: list[int] = []
    try:
        assert run(fast, tmp_path / "local").returncode == 0

        def kill() -> None:
            wait_for(lambda: slow.hits["chat"] >= 3, "three calls", timeout=120)
            running = busy_workers()
            if running:
                os.kill(running[0], signal.SIGKILL)
                killed.append(running[0])

        killer = threading.Thread(target=kill)
        killer.start()
        res = run(slow, tmp_path / "ray", "--engine", "ray", "--partitions", "2")
        killer.join()
    finally:
        fast.stop()
        slow.stop()
    assert killed, "no running partition task to kill"
    if res.returncode != 0:   # Ray gave up on the partition: the one-line error, then a rerun
        assert res.returncode == 1 and "rerun to resume" in res.stderr, res.stderr
        again = FakeLLMServer(answer=scripted).start()
        try:
            res = run(again, tmp_path / "ray", "--engine", "ray", "--partitions", "2")
        finally:
            again.stop()
    assert res.returncode == 0, res.stderr
    for t in TABLES:
        assert pl.read_parquet(tmp_path / "ray" / t).equals(
            pl.read_parquet(tmp_path / "local" / t)), t
    assert paid_twice(tmp_path / "ray" / "llm_calls.sqlite") == 0
