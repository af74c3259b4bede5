"""``draco run --engine ray`` on a local Ray cluster of two worker processes: the union of the
partitions equals the local engine's tables (on the sample and on the real tau-bench logs), a
rerun pays nothing — also when the stage was first run by the other engine —, an unreachable
cluster is a one-line error. Skipped when the ray extra is not installed."""

from __future__ import annotations

import json

import polars as pl
import pytest

from tests.conftest import TAU
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
    same_tables(tmp_path / "ray", tmp_path / "local")
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


def same_tables(a, b) -> None:
    for t in TABLES:
        assert pl.read_parquet(a / t).equals(pl.read_parquet(b / t)), t


@pytest.mark.skipif(not TAU.exists(), reason="the real tau-bench logs are not here")
def test_ray_engine_equals_local_on_the_real_tau_logs(cluster, server, tmp_path):
    """60 real tau-bench trajectories (15 tasks x 4 trials), both engines against the same
    local protocol server: identical tables; partitions hold several groups each."""
    from draco_cli.ingest import ingest

    ingest("tau-bench", [TAU], tmp_path / "tau", tokenizer="approx")
    ro, st = tmp_path / "tau" / "rollouts.parquet", tmp_path / "tau" / "steps.parquet"

    def tau_run(out, *extra):
        return draco("run", "--rollouts", ro, "--steps", st, "--model", "openai/m",
                     "--base-url", server.url + "/v1", "-o", out, *extra)

    assert tau_run(tmp_path / "local").returncode == 0
    hits = sum(server.hits.values())
    res = tau_run(tmp_path / "ray", "--engine", "ray", "--partitions", "4")
    assert res.returncode == 0, res.stderr
    same_tables(tmp_path / "ray", tmp_path / "local")
    assert len(list((tmp_path / "ray" / "ray").iterdir())) == 4
    groups = pl.read_parquet(ro)["group_id"].n_unique()
    assert groups == 15 and pl.read_parquet(tmp_path / "ray" / "rubric/rubrics.parquet")[
        "group_id"].n_unique() == groups
    # the ray run paid as many calls as the local one (the same requests, none twice)
    assert sum(server.hits.values()) - hits == hits
    assert paid_twice(tmp_path / "ray" / "llm_calls.sqlite") == 0


def test_local_then_ray_and_back_pay_nothing_twice(cluster, server, tmp_path):
    """A run folder made by the local engine, rerun with the ray engine with every stage
    redone: the partitions answer from the run's call log (0 requests); and the reverse, a
    ray-made folder redone by the local engine; the tables stay those of the local engine."""
    assert run(server, tmp_path / "a").returncode == 0
    ref = tmp_path / "ref"
    import shutil

    shutil.copytree(tmp_path / "a", ref)
    hits = sum(server.hits.values())
    assert hits > 0
    # unchanged inputs and options: the stages are reused whatever the engine
    res = run(server, tmp_path / "a", "--engine", "ray", "--partitions", "3")
    assert res.returncode == 0 and "skipped: rubric, judge, credit" in res.stderr, res.stderr
    res = run(server, tmp_path / "a", "--engine", "ray", "--partitions", "3", "--redo", "rubric")
    assert res.returncode == 0, res.stderr
    assert sum(server.hits.values()) == hits, "local -> ray paid again"
    assert "answered 18 of 18 requests (100%) (0 new, 18 reused)" in res.stderr, res.stderr
    same_tables(tmp_path / "a", ref)
    assert calls_in(tmp_path / "a" / "llm_calls.sqlite") == calls_in(ref / "llm_calls.sqlite")

    res = run(server, tmp_path / "b", "--engine", "ray", "--partitions", "2")
    assert res.returncode == 0, res.stderr
    hits = sum(server.hits.values())
    res = run(server, tmp_path / "b", "--redo", "rubric")
    assert res.returncode == 0, res.stderr
    assert sum(server.hits.values()) == hits, "ray -> local paid again"
    # and back to ray with another partition count: still nothing paid
    res = run(server, tmp_path / "b", "--engine", "ray", "--partitions", "5", "--redo", "rubric")
    assert res.returncode == 0, res.stderr
    assert sum(server.hits.values()) == hits, "ray (2) -> ray (5) paid again"
    same_tables(tmp_path / "b", ref)
    assert paid_twice(tmp_path / "b" / "llm_calls.sqlite") == 0


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
