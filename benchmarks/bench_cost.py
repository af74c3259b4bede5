"""Billed vs naive cost: what draco pays for rubric writing and k-sample judging against what a
naive client would (one call per sample, no prompt caching, no batch discount).

    python benchmarks/bench_cost.py [--groups 3]

Runs the real commands (`draco rubric generate`, then `draco judge score --samples k`) on a
slice of the real tau-bench sample (whole groups: the rollouts of a group share a rubric) against the local protocol server with prompt caching
accounted the way each provider does (``FakeLLMServer(caching=True)``: OpenAI's automatic
prefix cache, Anthropic's cache_control reads and writes), for openai/gpt-4.1 and
anthropic/claude-sonnet-4-5 at their list prices, with 0.3 s per call so that calls sent together miss each other's prefixes as they do at the providers (a cache holds a prefix once its prefill is done), (draco_cli/llm/prices.json), k = 1 and 3,
with the default for a hosted API (batch) and with --no-batch. The figures come from the call
log through ``draco_cli.audit.billed_vs_naive`` — the function behind `draco audit cost` —
with the calls sent online and through a batch API apart (``route``).

The goal figure is the online one (issue 33): billed ÷ naive of the calls sent online, over all
phases, at most 0.6 at k = 1 and 0.4 at k = 3; a batch call's half price says nothing about
caching, so batch rows are printed beside it and never count toward the goal. Last lines: one
``goal`` line per (model, k) saying met or not met, and
``worst_online_billed_over_naive_k1=<v> worst_online_billed_over_naive_k3=<v>``.

The server reaches the SDKs through OPENAI_BASE_URL / ANTHROPIC_BASE_URL, so draco treats it
as the hosted API (no --base-url). What it cannot show: real batch lines get cache hits only
best-effort (Anthropic) — the mock serves them from the same cache in order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = ("openai/gpt-4.1", "anthropic/claude-sonnet-4-5")
GOAL = {1: 0.6, 3: 0.4}   # online billed ÷ naive, all phases (issue 33)
LATENCY = 0.3   # s per call: calls sent at once miss each other's prefixes, as at the providers


def main() -> None:
    import polars as pl

    from draco_cli.audit import billed_vs_naive, read_cost_rows
    from tests.llm_server import FakeLLMServer, schema_answer
    from tests.conftest import TAU

    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=3, help="groups of the tau sample (4 "
                    "rollouts each)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-cost-"))
    data = tmp / "data"
    run = [sys.executable, "-m", "draco_cli"]
    res = subprocess.run(run + ["ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                                "-o", str(data)], capture_output=True, cwd=REPO)
    assert res.returncode == 0, res.stderr.decode()
    r = pl.read_parquet(data / "rollouts.parquet")
    groups = r["group_id"].unique(maintain_order=True).head(args.groups)
    keep = r.filter(pl.col("group_id").is_in(groups.implode()))
    keep.write_parquet(data / "r.parquet")
    pl.read_parquet(data / "steps.parquet").join(keep.select("rollout_id"), on="rollout_id") \
        .write_parquet(data / "s.parquet")
    print(f"{keep.height} rollouts of {TAU.name}, {keep['group_id'].n_unique()} groups")
    print(f"{'model':30} {'k':>2} {'mode':8} {'phase':8} {'route':7} {'calls':>6} {'naive':>6} "
          f"{'billed $':>10} {'naive $':>10} {'ratio':>6}")
    goals: dict[tuple[str, int], float] = {}
    for model in MODELS:
        for k in (1, 3):
            for mode in ("batch", "online"):
                server = FakeLLMServer(answer=schema_answer, caching=True, batch_polls=1,
                                        latency=LATENCY).start()
                try:
                    env = {**os.environ, "OPENAI_API_KEY": "sk-bench", "ANTHROPIC_API_KEY":
                           "sk-bench", "OPENAI_BASE_URL": server.url + "/v1",
                           "ANTHROPIC_BASE_URL": server.url}
                    env.pop("DRACO_BASE_URL", None)
                    out = tmp / f"{model.replace('/', '_')}-{k}-{mode}"
                    flag = [] if mode == "batch" else ["--no-batch"]
                    log = out / "llm_calls.sqlite"
                    common = ["--rollouts", str(data / "r.parquet"), "--steps",
                              str(data / "s.parquet"), "--model", model, "--call-log", str(log)]
                    res = subprocess.run(run + ["rubric", "generate", *common, "-o",
                                                str(out / "rubric"), *flag],
                                         capture_output=True, cwd=REPO, env=env)
                    assert res.returncode == 0, res.stderr.decode()[-2000:]
                    res = subprocess.run(run + ["judge", "score", *common, "--rubrics",
                                                str(out / "rubric" / "rubrics.parquet"),
                                                "--samples", str(k), "-o", str(out / "judge"),
                                                *flag], capture_output=True, cwd=REPO, env=env)
                    assert res.returncode == 0, res.stderr.decode()[-2000:]
                finally:
                    server.stop()
                table = billed_vs_naive(read_cost_rows(log))
                for row in table.iter_rows(named=True):
                    if row["phase"] not in ("score", "all"):
                        continue
                    print(f"{model:30} {k:>2} {mode:8} {row['phase']:8} {row['route']:7} "
                          f"{row['calls']:>6} {row['naive_calls']:>6} {row['billed_usd']:>10.4f} "
                          f"{row['naive_usd']:>10.4f} {row['billed_over_naive']:>6.3f}")
                    if mode == "online" and (row["phase"], row["route"]) == ("all", "online"):
                        goals[model, k] = row["billed_over_naive"]
                (tmp / "last.json").write_text(json.dumps(table.to_dicts()))
    for (model, k), ratio in goals.items():
        goal = GOAL[k]
        print(f"goal {model} k={k}: online billed/naive {ratio:.3f} (goal <= {goal}): "
              + ("met" if ratio <= goal else "NOT met"))
    print(" ".join(f"worst_online_billed_over_naive_k{k}="
                   f"{max(r for (_, kk), r in goals.items() if kk == k):.3f}" for k in GOAL))


if __name__ == "__main__":
    main()
