"""Ingest throughput and memory on the real tau-bench sample, replicated.

    python benchmarks/bench_ingest.py [--sizes 5000,50000] [--keep]

For each size N it writes a tau-bench results file of N trajectories (the 60 real ones of
../shared/data, repeated with distinct task ids), then, each in a fresh subprocess:
- ``draco_cli.ingest.ingest`` (the code ``draco ingest`` runs), with ``--tokenizer approx``;
- a baseline in the same run: ``json.load`` of the whole file (parse only, no work, not
  streamed) — the floor of any Python reader of this format, and what memory looks like
  without streaming.
It prints trajectories/s, peak RSS of each, and the ratios. Memory must not grow with input
size: the last line is ``ingest_peak_rss_ratio_50000_over_5000=<value>``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TAU = REPO.parent / "shared" / "data" / "tau-bench" / "gpt-4o-airline-15tasks.json"

CHILD_INGEST = """
import sys, time
from draco_cli.ingest import ingest
t = time.perf_counter()
r = ingest("tau-bench", [sys.argv[1]], sys.argv[2], tokenizer="approx", force=True)
print(time.perf_counter() - t, r.rollouts, r.steps)
"""
CHILD_JSON = """
import sys, time, json
t = time.perf_counter()
with open(sys.argv[1]) as f:
    d = json.load(f)
print(time.perf_counter() - t, len(d), 0)
"""


def make_input(n: int, path: Path) -> None:
    entries = json.loads(TAU.read_text())
    templates = []
    for e in entries:
        e = dict(e, task_id="__TID__")
        templates.append((json.dumps(e), e["trial"]))
    originals = [e["task_id"] for e in entries]
    with path.open("w") as f:
        f.write("[")
        for i in range(n):
            text, _ = templates[i % len(templates)]
            copy = i // len(templates)
            tid = f"{originals[i % len(templates)]}_{copy}"
            if i:
                f.write(", ")
            f.write(text.replace('"__TID__"', json.dumps(tid), 1))
        f.write("]")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="5000,50000")
    ap.add_argument("--keep", action="store_true", help="keep the generated inputs")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-ingest-"))
    results = {}
    try:
        for n in sizes:
            src = tmp / f"tau_{n}.json"
            t0 = time.perf_counter()
            make_input(n, src)
            gen = time.perf_counter() - t0
            size_mb = src.stat().st_size / 2**20
            out = tmp / f"out_{n}"
            # Time (printed by the child) and peak RSS (from wait4) of the same process.
            secs, rollouts, steps = _timed(CHILD_INGEST, str(src), str(out))
            rss = _LAST_RSS[0]
            jsecs, _, _ = _timed(CHILD_JSON, str(src))
            jrss = _LAST_RSS[0]
            results[n] = (secs, rss, jsecs, jrss)
            print(f"N={n:>6} input {size_mb:7.1f} MiB (generated in {gen:.1f}s)")
            print(f"  ingest    : {secs:7.2f} s  {rollouts / secs:9.0f} traj/s  "
                  f"{steps} steps  peak RSS {rss:7.1f} MiB")
            print(f"  json.load : {jsecs:7.2f} s  {n / jsecs:9.0f} traj/s  (parse only)  "
                  f"peak RSS {jrss:7.1f} MiB")
            print(f"  ratio ingest/json.load: time {secs / jsecs:.2f}x, memory {rss / jrss:.2f}x")
            src.unlink()
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    if len(sizes) >= 2:
        lo, hi = sizes[0], sizes[-1]
        per_lo = results[lo][0] / lo
        per_hi = results[hi][0] / hi
        print(f"time per trajectory {hi} vs {lo}: {per_hi / per_lo:.2f}x")
        print(f"json.load peak RSS {hi} vs {lo}: {results[hi][3] / results[lo][3]:.2f}x")
        print(f"ingest_peak_rss_ratio_{hi}_over_{lo}="
              f"{results[hi][1] / results[lo][1]:.2f}")


_LAST_RSS = [0.0]


def _timed(code: str, *args: str) -> tuple[float, int, int]:
    out, rss = run_child(code, *args)
    _LAST_RSS[0] = rss
    secs, rollouts, steps = out.split()
    return float(secs), int(rollouts), int(steps)


if __name__ == "__main__":
    main()
