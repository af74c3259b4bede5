"""Time a trainer asking for judge health after every step of a long run: a
``JudgeHealthHistory`` that takes each step once (``add`` then ``health()``), against the
baseline of ``judge_health_history`` over the whole history at every step (what a trainer had
before the history object). Synthetic steps of ``--rollouts`` rollouts in groups of 8, three
criteria each, outcomes 0/1.

    python benchmarks/bench_health_history.py [--steps 80] [--rollouts 512]

Prints the time of the last step's call and of the whole run for each, and checks the last
step's tables are equal. Last line: ``history_speedup=<ratio of the whole run's times>``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import polars as pl
from polars.testing import assert_frame_equal

from draco_cli.inloop import (CallTally, GroupScore, JudgeHealthHistory, StepResult,
                              judge_health_history)

CRITERIA = ("Calls the right API", "Confirms before paying", "Reports the balance")


def step(rng: np.random.Generator, s: int, n: int) -> tuple[StepResult, dict[str, float]]:
    groups, outcomes = [], {}
    for g in range(n // 8):
        gid = f"s{s}-g{g}"
        ids = [f"{gid}-r{i}" for i in range(8)]
        p = rng.random(8)
        verdicts = pl.DataFrame({
            "rollout_id": [r for r in ids for _ in CRITERIA],
            "criterion_id": [f"c{c}" for _ in ids for c in range(len(CRITERIA))],
            "verdict": np.where(rng.random(8 * len(CRITERIA)) < np.repeat(p, len(CRITERIA)),
                                "pass", "fail")})
        rubrics = pl.DataFrame({"group_id": gid, "criterion_id": [f"c{c}" for c in range(3)],
                                "title": list(CRITERIA)})
        rewards = pl.DataFrame({"rollout_id": ids, "group_id": gid, "reward": p})
        groups.append(GroupScore(gid, rubrics, pl.DataFrame(), verdicts, rewards,
                                 pl.DataFrame(), pl.DataFrame(), CallTally()))
        outcomes.update(zip(ids, (rng.random(8) < p).astype(float).tolist()))
    return StepResult(s, {}, {}, groups), outcomes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rollouts", type=int, default=512)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    run = [step(rng, s, a.rollouts) for s in range(a.steps)]

    history, t_hist, last_hist = JudgeHealthHistory(), 0.0, 0.0
    for result, outcomes in run:
        t = time.perf_counter()
        history.add(result, outcomes)
        incremental = history.health()
        last_hist = time.perf_counter() - t
        t_hist += last_hist

    t_full, last_full = 0.0, 0.0
    for k in range(1, a.steps + 1):
        t = time.perf_counter()
        whole = judge_health_history([r for r, _ in run[:k]], [o for _, o in run[:k]])
        last_full = time.perf_counter() - t
        t_full += last_full
    for name in ("steps", "criteria", "trends"):
        assert_frame_equal(getattr(incremental, name), getattr(whole, name), check_exact=True)

    print(f"{a.steps} steps x {a.rollouts} rollouts, judge health asked after every step")
    print(f"  JudgeHealthHistory.add + health : last step {last_hist * 1e3:8.1f} ms, "
          f"whole run {t_hist:7.2f} s")
    print(f"  judge_health_history (baseline) : last step {last_full * 1e3:8.1f} ms, "
          f"whole run {t_full:7.2f} s")
    print(f"history_speedup={t_full / t_hist:.1f}")


if __name__ == "__main__":
    main()
