"""Judge throughput of the in-loop API (draco_cli.inloop) against the CLI path (draco run's
library function), at equal concurrency, on local latency-injecting servers; then the in-loop
API over a fleet of 1, 2 and 4 endpoints that each serve one request at a time.

    python benchmarks/bench_inloop.py [--groups 40] [--concurrency 32]

Inputs: the sample's 3 groups copied under new ids to ``--groups`` groups (4 rollouts each), so
every group costs 6 rubric calls and 4 judge calls. Servers run in other processes (they do not
share the client's core). Part 1: each server adds 200 ms per call and serves any number at
once; ``draco run`` (rubric for every group, then judge for every rollout, then credit) vs
``Scorer.score_group`` for every group at once. Part 2: servers that serve one call at a time
(50 ms each, as llama.cpp on one slot), 1/2/4 of them as one fleet. Part 3 (when the ray
extra is installed; ``--no-ray`` skips it): ``draco run --engine ray`` against ``--engine local``
on the part-1 server at equal concurrency (``--concurrency`` is the whole run's bound with either
engine), Ray's start-up — the local cluster's ``ray.init`` and the first Ray Data job, which
starts the workers — measured on its own. Client CPU counts this process and every process it
started except the servers (Ray's driver, raylet, GCS and workers). Prints calls/s, client CPU
ms per call and the ratios; the last line is ``inloop_over_cli=<ratio> ray_over_local=<ratio>``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def serve(port_q: mp.Queue, latency: float, serial: bool) -> None:
    from tests.llm_server import FakeLLMServer, schema_answer

    s = FakeLLMServer(answer=schema_answer, latency=latency)
    s.serial = serial
    s.start()
    port_q.put(s.port)
    while True:
        time.sleep(3600)


def servers(n: int, latency: float, serial: bool) -> tuple[list[str], list]:
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=serve, args=(q, latency, serial), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return [f"http://127.0.0.1:{q.get(timeout=30)}/v1" for _ in procs], procs


def inputs(groups: int, tmp: Path):
    import polars as pl

    r = pl.read_parquet(REPO / "sample_data/appworld_mini/rollouts.parquet")
    s = pl.read_parquet(REPO / "sample_data/appworld_mini/steps.parquet")
    rs, ss = [], []
    for k in range(-(-groups // r["group_id"].n_unique())):
        tag = pl.lit(f"-{k}")
        rs.append(r.with_columns(pl.col("rollout_id") + tag, pl.col("group_id") + tag,
                                 pl.col("task_id") + tag, pl.col("instruction") + tag))
        ss.append(s.with_columns(pl.col("rollout_id") + tag))
    rollouts = pl.concat(rs)
    keep = rollouts["group_id"].unique(maintain_order=True).head(groups)
    rollouts = rollouts.filter(pl.col("group_id").is_in(keep.implode()))
    steps = pl.concat(ss).filter(pl.col("rollout_id").is_in(rollouts["rollout_id"].implode()))
    rollouts.write_parquet(tmp / "rollouts.parquet")
    steps.write_parquet(tmp / "steps.parquet")
    return rollouts, steps


def calls_in(log: Path) -> int:
    import sqlite3

    con = sqlite3.connect(log)
    try:
        return con.execute("select count(*) from calls where status = 'ok'").fetchone()[0]
    finally:
        con.close()


def by_group(rollouts, steps):
    import polars as pl

    for _, r in rollouts.partition_by("group_id", as_dict=True, maintain_order=True).items():
        yield r, steps.filter(pl.col("rollout_id").is_in(r["rollout_id"].implode()))


def inloop(urls, rollouts, steps, log: Path, concurrency: int) -> tuple[float, float, int]:
    from draco_cli import inloop as api

    async def go():
        async with api.Scorer("openai/bench", base_url=urls if len(urls) > 1 else urls[0],
                              call_log=log, concurrency=concurrency, adaptive=False) as scorer:
            return await asyncio.gather(*(scorer.score_group(r, s)
                                          for r, s in by_group(rollouts, steps)))

    t0, c0 = time.perf_counter(), time.process_time()
    scored = asyncio.run(go())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(g.calls.unanswered == 0 for g in scored), "unanswered calls in the benchmark"
    return wall, cpu, calls_in(log)


def cli(url, tmp: Path, out: Path, concurrency: int) -> tuple[float, float, int]:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.options import RunOptions
    from draco_cli.run.pipeline import run_step

    llm = LLMSettings(model="openai/bench", base_url=url, concurrency=concurrency,
                      adaptive=False)
    # the benchmark's judge answers every rollout alike: no signal, which a run refuses
    opts = RunOptions.for_setting("draco", allow_no_signal=True)
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_step(tmp / "rollouts.parquet", tmp / "steps.parquet", out, llm, opts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert res.manifest["status"] == "done", res.manifest["status"]
    return wall, cpu, calls_in(out / "llm_calls.sqlite")


def _proc_cpu(exclude: set[int]) -> float:
    """CPU seconds of this process and its living descendants, ``exclude`` and theirs left out
    (Ray's raylet, GCS and workers are descendants of the driver that started the cluster)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parent[int(d)], cpu[int(d)] = int(f[1]), (int(f[11]) + int(f[12])) / tick
    total, todo = time.process_time(), [os.getpid()]
    seen = {os.getpid()}
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in seen and c not in exclude:
                seen.add(c)
                todo.append(c)
                total += cpu[c]
    return total


def engine_run(engine: str, url: str, tmp: Path, out: Path, concurrency: int,
               partitions: int | None, exclude: set[int]) -> tuple[float, float, int]:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.run.pipeline import RunOptions, run_step

    llm = LLMSettings(model="openai/bench", base_url=url, concurrency=concurrency,
                      adaptive=False)
    opts = RunOptions(engine=engine, partitions=partitions)
    t0, c0 = time.perf_counter(), _proc_cpu(exclude)
    res = run_step(tmp / "rollouts.parquet", tmp / "steps.parquet", out, llm, opts)
    wall, cpu = time.perf_counter() - t0, _proc_cpu(exclude) - c0
    assert res.manifest["status"] == "done", res.manifest["status"]
    return wall, cpu, calls_in(out / "llm_calls.sqlite")


def _import_draco(batch):
    import draco_cli.run.ray_engine  # noqa: F401
    import draco_cli.judge.stage  # noqa: F401

    return batch


def ray_vs_local(url: str, tmp: Path, concurrency: int, partitions: int | None,
                 servers_pids: set[int]) -> float:
    import polars as pl
    import pyarrow as pa
    import ray

    # the first run in a process pays its imports: warm up, then measure a second run
    engine_run("local", url, tmp, tmp / "local-warmup", concurrency, partitions, servers_pids)
    w_loc, c_loc, n_loc = engine_run("local", url, tmp, tmp / "local", concurrency,
                                     partitions, servers_pids)
    t0 = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    t_init = time.perf_counter() - t0
    t0 = time.perf_counter()   # the first Ray Data job starts the workers, which import draco
    ray.data.from_arrow([pa.table({"k": [k]}) for k in range(os.cpu_count() or 1)]).map_batches(
        _import_draco, batch_size=None, batch_format="pyarrow").take_all()
    t_warm = time.perf_counter() - t0
    try:
        w_ray, c_ray, n_ray = engine_run("ray", url, tmp, tmp / "ray", concurrency, partitions,
                                         servers_pids)
    finally:
        ray.shutdown()
    assert n_ray == n_loc, (n_ray, n_loc)
    for t in ("rubric/rubrics.parquet", "judge/verdicts.parquet",
              "credit/token_advantages.parquet"):
        assert pl.read_parquet(tmp / "ray" / t).equals(pl.read_parquet(tmp / "local" / t)), t
    startup = t_init + t_warm
    print(f"--engine local:           {n_loc} calls in {w_loc:6.2f} s = {n_loc / w_loc:6.1f} "
          f"calls/s, client CPU {1000 * c_loc / n_loc:5.2f} ms/call")
    parts = len(list((tmp / "ray" / "ray").glob("part-*")))
    print(f"--engine ray ({parts} parts):   {n_ray} calls in {w_ray:6.2f} s = "
          f"{n_ray / w_ray:6.1f} calls/s, client CPU {1000 * c_ray / n_ray:5.2f} ms/call "
          "(driver, raylet, GCS, workers)")
    print(f"Ray start-up (not in the figure above): ray.init {t_init:.2f} s + first Ray Data "
          f"job (workers start, import draco) {t_warm:.2f} s = {startup:.2f} s")
    print(f"ray / local calls/s: {(n_ray / w_ray) / (n_loc / w_loc):.2f}; CPU per call ratio "
          f"{(c_ray / n_ray) / (c_loc / n_loc):.2f}; ray slower by {w_ray - w_loc:+.2f} s "
          f"({'within' if w_ray - w_loc <= startup else 'MORE than'} its start-up "
          f"{startup:.2f} s)")
    return (n_ray / w_ray) / (n_loc / w_loc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--partitions", type=int, default=None,
                    help="--engine ray's partitions (default: the cluster's CPUs, as draco run)")
    ap.add_argument("--no-ray", action="store_true", help="skip --engine ray vs local")
    ap.add_argument("--only-ray", action="store_true", help="only --engine ray vs local")
    args = ap.parse_args()
    try:
        import ray.data  # noqa: F401
    except ImportError:
        args.no_ray = True
    os.environ.setdefault("OPENAI_API_KEY", "sk-bench-local-only")
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-inloop-"))
    procs = []
    try:
        rollouts, steps = inputs(args.groups, tmp)
        print(f"{args.groups} groups, {rollouts.height} rollouts, concurrency "
              f"{args.concurrency}")
        urls, procs = servers(1, 0.2, serial=False)
        ray_ratio = None
        if not args.no_ray:
            ray_ratio = ray_vs_local(urls[0], tmp, args.concurrency, args.partitions,
                                     {p.pid for p in procs})
            if args.only_ray:
                print(f"ray_over_local={ray_ratio:.2f}")
                return
        w_cli, c_cli, n_cli = cli(urls[0], tmp, tmp / "cli", args.concurrency)
        w_api, c_api, n_api = inloop(urls, rollouts, steps, tmp / "api.sqlite",
                                     args.concurrency)
        assert n_cli == n_api, (n_cli, n_api)
        ratio = (n_api / w_api) / (n_cli / w_cli)
        print(f"CLI path (draco run):  {n_cli} calls in {w_cli:6.2f} s = {n_cli / w_cli:6.1f} "
              f"calls/s, client CPU {1000 * c_cli / n_cli:5.2f} ms/call")
        print(f"in-loop (score_group): {n_api} calls in {w_api:6.2f} s = {n_api / w_api:6.1f} "
              f"calls/s, client CPU {1000 * c_api / n_api:5.2f} ms/call")
        print(f"in-loop / CLI calls/s: {ratio:.2f}; CPU per call ratio "
              f"{(c_api / n_api) / (c_cli / n_cli):.2f}")
        for p in procs:
            p.terminate()
        urls, procs = servers(4, 0.05, serial=True)
        base = None
        for n in (1, 2, 4):
            w, c, k = inloop(urls[:n], rollouts, steps, tmp / f"fleet{n}.sqlite",
                             args.concurrency)
            base = base or k / w
            print(f"fleet of {n} one-at-a-time endpoints (50 ms/call): {k} calls in {w:6.2f} s "
                  f"= {k / w:6.1f} calls/s, x{(k / w) / base:.2f} of one endpoint")
        print(f"inloop_over_cli={ratio:.2f}"
              + (f" ray_over_local={ray_ratio:.2f}" if ray_ratio is not None else ""))
    finally:
        for p in procs:
            p.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
