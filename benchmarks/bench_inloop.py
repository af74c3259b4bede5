"""Judge throughput of the in-loop API (draco_cli.api) against the CLI path (draco run's
library function), at equal concurrency, on local latency-injecting servers; then the in-loop
API over a fleet of 1, 2 and 4 endpoints that each serve one request at a time.

    python benchmarks/bench_inloop.py [--groups 40] [--concurrency 32]

Inputs: the sample's 3 groups copied under new ids to ``--groups`` groups (4 rollouts each), so
every group costs 6 rubric calls and 4 judge calls. Servers run in other processes (they do not
share the client's core). Part 1: each server adds 200 ms per call and serves any number at
once; ``draco run`` (rubric for every group, then judge for every rollout, then credit) vs
``Scorer.score_group`` for every group at once. Part 2: servers that serve one call at a time
(50 ms each, as llama.cpp on one slot), 1/2/4 of them as one fleet. Prints calls/s, client CPU
ms per call and the ratios; the last line is ``inloop_over_cli=<ratio>``.
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
    from draco_cli.llm.mockserver import FakeLLMServer, schema_answer

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
    from draco_cli import api

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
    from draco_cli.ops.run import run_step

    llm = LLMSettings(model="openai/bench", base_url=url, concurrency=concurrency,
                      adaptive=False)
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_step(tmp / "rollouts.parquet", tmp / "steps.parquet", out, llm)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert res.manifest["status"] == "done", res.manifest["status"]
    return wall, cpu, calls_in(out / "llm_calls.sqlite")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("OPENAI_API_KEY", "sk-bench-local-only")
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-inloop-"))
    procs = []
    try:
        rollouts, steps = inputs(args.groups, tmp)
        print(f"{args.groups} groups, {rollouts.height} rollouts, concurrency "
              f"{args.concurrency}")
        urls, procs = servers(1, 0.2, serial=False)
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
        print(f"inloop_over_cli={ratio:.2f}")
    finally:
        for p in procs:
            p.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
