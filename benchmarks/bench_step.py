"""Time a training step waits for its advantages: scoring in the loop (``StepScorer``, each group
judged the moment its last rollout finishes) against judging after generation (``draco run``'s
library function on the whole step once the last rollout is done).

    python benchmarks/bench_step.py [--groups 64] [--group-size 8] [--spread 30]

A judge server in another process answers after 1 s and serves at most ``--capacity`` requests
at once (above the rate the schedule produces, so a backlog is the client's doing). Rollouts
(random token ids, 3 policy turns with tool results between) finish over a staggered schedule:
group k's members end within 0.5 s before ``k * spread / groups``. Figures, each on a fresh
call log: ``alone`` — the last group scored on an idle server (its chain of rubric and judge
calls); ``in_loop`` — from the last rollout's end to the step's advantages, in-loop; ``after`` —
the same for judging after generation. Last line: ``in_loop_over_alone=<r>
after_over_alone=<r>`` (goal: in-loop ≤ 1.2× alone, whatever the number of groups).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def serve(port_q: mp.Queue, latency: float, capacity: int) -> None:
    from tests.llm_server import FakeLLMServer, schema_answer

    s = FakeLLMServer(answer=schema_answer, latency=latency)
    s.capacity = capacity
    s.start()
    port_q.put(s.port)
    while True:
        time.sleep(3600)


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def schedule(groups: int, size: int, spread: float, seed: int = 0) -> list[tuple[float, object]]:
    import numpy as np

    from draco_cli.inloop import TrainerRollout

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        end = (g + 1) * spread / groups
        for k in range(size):
            mask = [1] * 12 + [0] * 6 + [1] * 10 + [0] * 6 + [1] * 8
            ids = rng.integers(0, 30000, len(mask))
            r = TrainerRollout(f"g{g}-{k}", f"g{g}", f"Task {g}: book the cheapest flight "
                               f"from city {g % 7} to city {(g * 3) % 11}.", ids, mask,
                               outcome=float(rng.integers(0, 2)), train_step=1)
            out.append((end - 0.5 * rng.random() if k else end, r))
    return sorted(out, key=lambda x: x[0])


async def in_loop(url: str, log: Path, plan, size: int, concurrency: int) -> float:
    from draco_cli.inloop import StepScorer

    async with StepScorer("openai/bench", base_url=url, call_log=log, group_size=size,
                          decode=decode, concurrency=concurrency, adaptive=False) as s:
        t0 = time.monotonic()
        for at, r in plan:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            await s.add(r)
        last = time.monotonic()
        res = await s.finish(1)
    assert not res.fallbacks and res.metrics["draco/unanswered_share"] == 0, res.metrics
    return time.monotonic() - last


def after(url: str, tmp: Path, plan, concurrency: int) -> float:
    from draco_cli.inloop import trainer_rows
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.run.pipeline import run_step

    r, s = trainer_rows([x for _, x in plan], decode)
    r.drop("policy_spans").write_parquet(tmp / "rollouts.parquet")
    s.write_parquet(tmp / "steps.parquet")
    llm = LLMSettings(model="openai/bench", base_url=url, concurrency=concurrency,
                      adaptive=False)
    from draco_cli.options import RunOptions

    # the server answers every rollout alike (no signal); timing is the point here
    t0 = time.monotonic()
    res = run_step(tmp / "rollouts.parquet", tmp / "steps.parquet", tmp / "run", llm,
                   RunOptions(allow_no_signal=True))
    assert res.manifest["status"] == "done", res.manifest["status"]
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--spread", type=float, default=30.0, help="seconds over which groups end")
    ap.add_argument("--latency", type=float, default=1.0)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=256)
    a = ap.parse_args()
    q: mp.Queue = mp.Queue()
    server = mp.Process(target=serve, args=(q, a.latency, a.capacity), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{q.get(timeout=30)}/v1"
    plan = schedule(a.groups, a.group_size, a.spread)
    last_group = [x for x in plan if x[1].group_id == plan[-1][1].group_id]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # twice, each on a fresh log; the first also warms the server and the client's imports
        alone = min(asyncio.run(in_loop(url, tmp / f"alone{k}.sqlite",
                                        [(0.0, r) for _, r in last_group], a.group_size,
                                        a.concurrency)) for k in range(2))
        loop = asyncio.run(in_loop(url, tmp / "loop.sqlite", plan, a.group_size,
                                   a.concurrency))
        post = after(url, tmp, plan, a.concurrency)
    server.terminate()
    print(f"{a.groups} groups x {a.group_size} rollouts over {a.spread:g} s, judge "
          f"{a.latency:g} s per call, capacity {a.capacity}")
    print(f"alone    {alone:7.2f} s  (the last group on an idle server)")
    print(f"in_loop  {loop:7.2f} s  from the last rollout's end to the step's advantages")
    print(f"after    {post:7.2f} s  judging after generation (draco run's library function)")
    print(f"in_loop_over_alone={loop / alone:.2f} after_over_alone={post / alone:.2f}")


if __name__ == "__main__":
    main()
