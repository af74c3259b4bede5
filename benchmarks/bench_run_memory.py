"""``draco run`` peak memory as the number of rollouts grows.

    python benchmarks/bench_run_memory.py [--sizes 10000,100000] [--latency 0.005]
        [--against SRC [--against-sizes 10000]]

Tiles the sample rollouts (sample_data/appworld_mini: rollouts and steps repeated with suffixed
ids, so groups keep their size) to each size, starts the test LLM server
(``tests/llm_server.py``) in another process (answers made from each request's schema,
``--latency`` seconds per call; a fresh server per run), and runs the
real ``draco run`` command against it (``openai/mock``, ``--concurrency 64``) in a fresh
process per size. Prints wall time and the process's peak RSS (``wait4``) per size, and the
ratio of the largest size's peak to the smallest's. Target (issue 19): flat, within ±20%.
Each size is a full run: 100,000 rollouts make well over 100,000 calls (minutes of wall).

``--against SRC`` also runs another draco source tree (e.g. ``git archive main | tar -x -C
/tmp/main``) on the same inputs in turn (each run with a fresh server; which goes first
alternates from size to size), and prints its peak and wall and the ratios this/other; the two runs' tables are compared (every Parquet table of the run
folder equal row for row; the call logs equal as sets of answered requests) and a difference
fails the benchmark.

``DRACO_RSS_PROBE=1`` in the environment makes ``draco run`` print its RSS and its peak per
stage (``RUN_WITH_PROBE`` below); they are printed under each run (the process's peak is then the
largest of them, as the probe resets the kernel's figure at each stage boundary).
``--keep DIR`` keeps the tiled inputs and run folders there, to measure a stage alone after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_measured  # noqa: E402

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
        return int(s.getsockname()[1])


@contextlib.contextmanager
def mock_server(latency: float) -> Iterator[int]:
    """A fresh test LLM server (its prompt-cache state starts empty for every run,
    so neither of two runs in turn finds the other's prompts warm); yields its port."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tests.llm_server",
                               "--port", str(port), "--latency", str(latency)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port
    finally:
        server.terminate()
        server.wait()


def draco_run(src: Path, r: Path, s: Path, out: Path, latency: float) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one ``draco run`` from the source tree ``src``."""
    env = dict(os.environ, OPENAI_API_KEY="sk-bench-local-only",
               PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with mock_server(latency) as port:
        t = time.perf_counter()
        # through _child's launcher: a child forked from this process would report our own
        # peak (the tiling's) as its floor
        status, peak, _, err = run_measured(
            [sys.executable, "-c", RUN_WITH_PROBE, "run", "--rollouts", str(r), "--steps",
             str(s), "--model", "openai/mock", "--base-url", f"http://127.0.0.1:{port}/v1",
             "--concurrency", "64", "-o", str(out),
             # the mock server judges every rollout alike: no learning signal, which the run
             # refuses by default; the memory is the point here
             "--allow-no-signal"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=src, env=env)
        wall = time.perf_counter() - t
    if status:
        raise SystemExit(f"draco run ({src}) failed: {err.decode()[-2000:]}")
    for line in err.decode(errors="replace").splitlines():   # DRACO_RSS_PROBE=1 (run.py)
        if line.startswith("draco rss-probe"):
            print("   ", line, flush=True)
            # the probe resets the kernel's peak at each stage boundary: the process's peak
            # is then the largest of the probe's figures and wait4's (the last segment's)
            peak = max(peak, float(line.rsplit("peak since last ", 1)[1].split()[0]))
    return wall, peak


# ``draco`` with DRACO_RSS_PROBE=1: the RSS and its peak since the last probe printed at each
# stage's start and end, the peak then reset (Linux ``clear_refs``), so each stage's own peak
# shows in one run. Trees from before 2026-12-07 print it themselves (``_allocator.rss_probe``).
RUN_WITH_PROBE = """
import os, sys
from pathlib import Path
import draco_cli._allocator, draco_cli.cli.run as run
def probe(where):
    try:
        status = Path("/proc/self/status").read_text()
        kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in status.splitlines())
              if k in ("VmRSS", "VmHWM")}
        print(f"draco rss-probe {where}: rss {kb['VmRSS'] / 1024:.1f} MiB, peak since last "
              f"{kb['VmHWM'] / 1024:.1f} MiB", file=sys.stderr, flush=True)
        Path("/proc/self/clear_refs").write_text("5")
    except (OSError, KeyError, ValueError):
        pass
if os.environ.get("DRACO_RSS_PROBE") == "1" and not hasattr(draco_cli._allocator, "rss_probe"):
    on_event = run._on_event
    def probed(e):
        on_event(e)   # first: at a stage's start it hands freed memory back
        if e.event in ("start", "end"):
            probe(f"{e.stage} {e.event}")
    run._on_event = probed
from draco_cli.cli import main
sys.argv[0] = "draco"
main()
"""


def same_outputs(a: Path, b: Path) -> list[str]:
    """Differences between two run folders' tables (none: the same run)."""
    diffs = []
    tables = sorted(str(p.relative_to(a)) for p in a.rglob("*.parquet")
                    if p.name != "llm_calls.parquet")
    other = sorted(str(p.relative_to(b)) for p in b.rglob("*.parquet")
                   if p.name != "llm_calls.parquet")
    if tables != other:
        diffs.append(f"tables differ: {tables} vs {other}")
    for rel in tables:
        if rel in other and not pl.read_parquet(a / rel).equals(pl.read_parquet(b / rel)):
            diffs.append(f"{rel} differs")
    # The call log: the same requests answered the same way (row order and timings follow
    # the server's scheduling, not draco's).
    cols = ["request_hash", "sample", "phase", "key", "status", "answer_text", "parsed"]
    logs = [pl.read_parquet(d / "judge" / "llm_calls.parquet", columns=cols)
            .sort(cols, nulls_last=True) for d in (a, b)]
    if not logs[0].equals(logs[1]):
        diffs.append("call logs differ")
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--latency", type=float, default=0.005)
    ap.add_argument("--against", type=Path, help="another draco source tree to compare with")
    ap.add_argument("--against-sizes", default=None,
                    help="sizes run with --against too (default: the smallest)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="A/B pairs per size with --against (order alternating; walls summed)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the tiled inputs and run folders in this folder (to measure a "
                         "stage alone afterwards)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    against = [int(s) for s in args.against_sizes.split(",")] if args.against_sizes \
        else sizes[:1]
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-run-")) if args.keep is None \
        else args.keep.resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    got: dict[int, float] = {}
    failed = False
    try:
        for n in sizes:
            r, s, real = tile(n, tmp)
            runs = [("this", REPO)]
            if args.against and n in against:
                # in turn, alternating which goes first (warm disk cache, drifting load)
                other = ("other", args.against.resolve())
                runs = [p for k in range(args.rounds)
                        for p in ([runs[0], other] if k % 2 == 0 else [other, runs[0]])]
            seen: dict[str, tuple[float, float]] = {}
            for name, src in runs:
                shutil.rmtree(tmp / f"{name}{n}", ignore_errors=True)
                wall, rss = draco_run(src, r, s, tmp / f"{name}{n}", args.latency)
                w0, r0 = seen.get(name, (0.0, 0.0))
                seen[name] = (w0 + wall, max(r0, rss))   # walls summed over rounds
                label = "draco run" if name == "this" else str(args.against)
                print(f"{real:>7} rollouts: {label} {wall:7.1f} s, peak RSS "
                      f"{rss:8.1f} MiB", flush=True)
            got[n] = seen["this"][1]
            if "other" in seen:
                (wall, rss), (wall_o, rss_o) = seen["this"], seen["other"]
                print(f"run_peak_rss_ratio_this_over_other_{n}={rss / rss_o:.2f}")
                print(f"run_wall_ratio_this_over_other_{n}={wall / wall_o:.2f}")
                diffs = same_outputs(tmp / f"this{n}", tmp / f"other{n}")
                print(f"outputs at {n}: " + ("identical" if not diffs else "; ".join(diffs)))
                failed = failed or bool(diffs)
            for name in seen if args.keep is None else ():
                shutil.rmtree(tmp / f"{name}{n}", ignore_errors=True)
        lo, hi = sizes[0], sizes[-1]
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        print(f"run_peak_rss_ratio_{hi}_over_{lo}={got[hi] / got[lo]:.2f}")
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    if failed:
        raise SystemExit("the two draco versions wrote different outputs")


if __name__ == "__main__":
    main()
