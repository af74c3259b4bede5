"""``draco run`` peak memory as the number of rollouts grows.

    python benchmarks/bench_run_memory.py [--sizes 10000,100000] [--latency 0.005]

Tiles the sample rollouts (sample_data/appworld_mini: rollouts and steps repeated with suffixed
ids, so groups keep their size) to each size, starts ``draco llm mock-server`` in another
process (answers made from each request's schema, ``--latency`` seconds per call), and runs the
real ``draco run`` command against it (``openai/mock``, ``--concurrency 64``) in a fresh
process per size. Prints wall time and the process's peak RSS (``wait4``) per size, and the
ratio of the largest size's peak to the smallest's. Target (issue 19): flat, within ±20%.
Each size is a full run: 100,000 rollouts make well over 100,000 calls (minutes of wall).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_data" / "appworld_mini"


def tile(n: int, dst: Path) -> tuple[Path, Path, int]:
    rollouts = pl.read_parquet(SAMPLE / "rollouts.parquet")
    k = max(1, round(n / rollouts.height))
    copies = pl.Series("__copy", range(k)).to_frame()
    out = []
    for name in ("rollouts", "steps"):
        df = pl.read_parquet(SAMPLE / f"{name}.parquet")
        tiled = copies.join(df, how="cross").with_columns(
            (pl.col(c) + "-" + pl.col("__copy").cast(pl.String)).alias(c)
            for c in ("rollout_id", "group_id", "task_id") if c in df.columns
        ).drop("__copy").select(df.columns)
        path = dst / f"{name}-{n}.parquet"
        tiled.write_parquet(path)
        out.append(path)
    return out[0], out[1], rollouts.height * k


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--latency", type=float, default=0.005)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-run-"))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "draco_cli", "llm", "mock-server",
                               "--port", str(port), "--latency", str(args.latency)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    env = dict(os.environ, OPENAI_API_KEY="sk-bench-local-only")
    got: dict[int, float] = {}
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        for n in sizes:
            r, s, real = tile(n, tmp)
            t = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "draco_cli", "run", "--rollouts", str(r), "--steps",
                 str(s), "--model", "openai/mock", "--base-url", f"http://127.0.0.1:{port}/v1",
                 "--concurrency", "64", "-o", str(tmp / f"run{n}")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - t
            if status:
                raise SystemExit(f"draco run failed at {n}: {proc.stderr.read().decode()[-2000:]}")
            rss = usage.ru_maxrss / 1024
            got[n] = rss
            print(f"{real:>7} rollouts: draco run {wall:7.1f} s, peak RSS {rss:8.1f} MiB",
                  flush=True)
            shutil.rmtree(tmp / f"run{n}", ignore_errors=True)
        lo, hi = sizes[0], sizes[-1]
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        print(f"run_peak_rss_ratio_{hi}_over_{lo}={got[hi] / got[lo]:.2f}")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
