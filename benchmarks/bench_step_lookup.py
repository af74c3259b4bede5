"""Time a trainer's sessions spend fetching their advantages from a ``StepScorer`` once their
groups are scored: ``await scorer.advantages(rollout_id)`` for every rollout of a step (what
verl's and rLLM's per-session hooks call), against the baseline of reading the same rows from
the finished step's ``StepResult.rows`` dict.

    python benchmarks/bench_step_lookup.py [--rollouts 8192] [--group-size 8]

The judge is the in-process mock provider (no server): only the scorer's own bookkeeping is
timed, on the event loop the trainer's sessions share. Last line: ``lookup_over_dict=<ratio>``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from draco_cli.inloop import StepScorer, TrainerRollout


async def measure(n: int, group: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    rollouts = [TrainerRollout(f"r{i}", f"g{i // group}", f"task {i // group}",
                               rng.integers(0, 500, 12), [1] * 6 + [0] * 2 + [1] * 4,
                               outcome=float(i % 2), train_step=1, row=i) for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        async with StepScorer("mock/judge", group_size=group, call_log=Path(tmp) / "log.sqlite",
                              decode=lambda ids: " ".join(map(str, ids))) as scorer:
            for r in rollouts:
                await scorer.add(r)
            for r in rollouts:   # every group scored before the clock starts
                await scorer.advantages(r.rollout_id, 1)
            t = time.perf_counter()
            for r in rollouts:
                await scorer.advantages(r.rollout_id, 1)
            lookup = time.perf_counter() - t
            result = await scorer.finish(1)
    t = time.perf_counter()
    for r in rollouts:
        result.rows[r.rollout_id]
    return lookup, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=8192)
    ap.add_argument("--group-size", type=int, default=8)
    a = ap.parse_args()
    lookup, plain = asyncio.run(measure(a.rollouts, a.group_size))
    print(f"{a.rollouts} rollouts, groups of {a.group_size}")
    print(f"  scorer.advantages() for every rollout : {lookup:.4f} s")
    print(f"  StepResult.rows[...] for every rollout: {plain:.4f} s")
    print(f"lookup_over_dict={lookup / plain:.1f}")


if __name__ == "__main__":
    main()
