"""``draco audit cost`` peak memory as the call log grows.

    python benchmarks/bench_audit_cost.py [--sizes 10000,100000] [--against SRC]

Writes a call log of each size (rows shaped like draco's: a 6 KB request, a 6 KB response and
a 6 KB answer text, random hex so that Parquet cannot compress them away; every fifth reply
answers two samples; a mix of phases, statuses, models and batches; rollouts with train steps)
and runs the real ``draco audit cost --calls LOG --rollouts R`` on it in a fresh process, on the
SQLite log and on its Parquet export (~18 MB row groups, as draco exports it). Prints wall time
and the process's own peak RSS (``_child.run_measured``) per size, and the ratio of the largest
size's peak to the smallest's: the command reads only the cost columns, so the text, most of a
log, should not count. ``--against SRC`` runs another draco source tree (e.g. ``git archive
main | tar -x -C /tmp/main``) in turn on the same logs, prints the ratios this/other, and fails
if the four output tables differ.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
from polars.testing import assert_frame_equal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import REPO, run_child  # noqa: E402

TABLES = ("cost_phase", "cost_step", "cost_category", "cost_naive")
AUDIT = """
import sys
from draco_cli.cli import main
sys.argv = ["draco", "audit", "cost", "--calls", sys.argv[1], "--rollouts", sys.argv[2], "-o",
            sys.argv[3], "--force", "--json"]
main()
"""


def write_log(n: int, dst: Path) -> tuple[Path, Path, Path]:
    sys.path.insert(0, str(REPO))
    from draco_cli.llm.calllog import CallLog
    from draco_cli.llm.export import export_parquet

    rng = random.Random(n)
    log = dst / f"calls-{n}.sqlite"
    with CallLog(log) as calls:
        for i in range(n):
            for sample in range(1 + (i % 5 == 0)):
                calls.record(
                    request_hash=f"h{i}", content_hash=f"c{i}", sample=sample,
                    phase=rng.choice(["score", "merge", "write"]),
                    key=f"r{i // 3}" if i % 2 else f"g{i // 12}", provider="openai",
                    model=rng.choice(["gpt-4.1", "gpt-4.1-mini", "local/unpriced"]), attempt=0,
                    status=rng.choice(["ok", "ok", "ok", "invalid", "http_error"]),
                    request=rng.randbytes(3000).hex(),
                    response=json.dumps({"id": i, "t": rng.randbytes(3000).hex()}),
                    answer_text=rng.randbytes(3000).hex(), parsed="{}", input_tokens=rng.randint(100, 5000),
                    cached_tokens=rng.choice([0, None, 64]), output_tokens=rng.randint(1, 500),
                    latency_s=0.1, cost_usd=rng.random() / 100,
                    batch_id=None if i % 3 else "b1")
    export = dst / f"calls-{n}.parquet"
    export_parquet(log, export)   # as `draco llm export` writes it: ~16 MB row groups
    m = n // 3 + 1
    rollouts = dst / f"rollouts-{n}.parquet"
    pl.DataFrame({"rollout_id": [f"r{i}" for i in range(m)],
                  "group_id": [f"g{i // 4}" for i in range(m)], "task_id": "t",
                  "train_step": [i % 5 for i in range(m)]}).write_parquet(rollouts)
    return log, export, rollouts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--against", help="another draco source tree to run in turn")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-audit-cost-"))
    peaks: dict[str, list[float]] = {}
    try:
        for n in sizes:
            log, export, rollouts = write_log(n, work)
            for calls in (log, export):
                kind = calls.suffix[1:]
                runs = [("this", None)] + ([("other", a.against)] if a.against else [])
                got = {}
                for name, src in runs:
                    out = work / f"out-{name}-{kind}-{n}"
                    t0 = time.perf_counter()
                    _, peak = run_child(AUDIT, str(calls), str(rollouts), str(out),
                                        source=src)
                    got[name] = (time.perf_counter() - t0, peak)
                    peaks.setdefault(f"{name} {kind}", []).append(peak)
                line = (f"n={n:>7} {kind:<7} log {calls.stat().st_size / 2**20:7.0f} MiB  "
                        f"this: wall {got['this'][0]:5.1f} s peak {got['this'][1]:6.0f} MiB")
                if a.against:
                    line += (f"  other: wall {got['other'][0]:5.1f} s peak "
                             f"{got['other'][1]:6.0f} MiB  peak this/other "
                             f"{got['this'][1] / got['other'][1]:.2f}")
                    for t in TABLES:
                        assert_frame_equal(
                            pl.read_parquet(work / f"out-this-{kind}-{n}" / f"{t}.parquet"),
                            pl.read_parquet(work / f"out-other-{kind}-{n}" / f"{t}.parquet"))
                    line += "  tables equal"
                print(line, flush=True)
            log.unlink()
            export.unlink()
        for name, p in peaks.items():
            print(f"peak_ratio_{name.replace(' ', '_')}={p[-1] / p[0]:.2f} "
                  f"({sizes[-1]} vs {sizes[0]} calls)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
