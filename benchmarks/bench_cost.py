"""Billed vs naive cost: what draco pays for rubric writing and k-sample judging against what a
naive client would (one call per sample, no prompt caching, no batch discount).

    python benchmarks/bench_cost.py [--groups 3]

Runs the real commands (`draco rubric generate`, then `draco judge score --samples k`) on a
slice of the real tau-bench sample (whole groups: the rollouts of a group share a rubric) against the local protocol server with prompt caching
accounted the way each provider does (``FakeLLMServer(caching=True)``: OpenAI's automatic
prefix cache, Anthropic's cache_control reads and writes), for openai/gpt-4.1 and
anthropic/claude-sonnet-4-5 at their list prices (draco_cli/llm/prices.json), k = 1 and 3,
with the default for a hosted API (batch) and with --no-batch. The figures come from the call
log through ``draco_cli.audit.billed_vs_naive`` — the function behind `draco audit cost`.
Last line: ``worst_billed_over_naive_batch=<value>`` (target <= 0.5).

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
    print(f"{'model':30} {'k':>2} {'mode':8} {'phase':8} {'calls':>6} {'naive':>6} "
          f"{'billed $':>10} {'naive $':>10} {'ratio':>6}")
    worst_batch = 0.0
    for model in MODELS:
        for k in (1, 3):
            for mode in ("batch", "online"):
                server = FakeLLMServer(answer=schema_answer, caching=True, batch_polls=1).start()
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
                    print(f"{model:30} {k:>2} {mode:8} {row['phase']:8} {row['calls']:>6} "
                          f"{row['naive_calls']:>6} {row['billed_usd']:>10.4f} "
                          f"{row['naive_usd']:>10.4f} {row['billed_over_naive']:>6.3f}")
                    if mode == "batch" and row["phase"] == "all":
                        worst_batch = max(worst_batch, row["billed_over_naive"])
                (tmp / "last.json").write_text(json.dumps(table.to_dicts()))
    print(f"worst_billed_over_naive_batch={worst_batch:.3f}")


if __name__ == "__main__":
    main()
