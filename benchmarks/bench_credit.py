"""Credit throughput and memory on synthetic training steps.

    python benchmarks/bench_credit.py [--sizes 10000,100000,1000000]

For each size it writes a synthetic training step (groups of 8 rollouts, ~20 steps of ~100
tokens with token positions and policy spans, 6 criteria per group, random verdicts and 1–3
citations each) as Parquet, then runs in fresh subprocesses:
- ``draco credit compute`` (its library call, spans output, with the allocator setting the
  ``draco`` command applies at start-up): read, check, filter, rewards,
  advantages, step credit, token advantages, atomic writes;
- the **I/O floor** in the same run: pyarrow reading the same three inputs and writing three
  outputs of the same size (the files credit compute wrote), with no computation.
It prints wall time, rollouts/s, peak RSS, the ratio to the floor, and cost per rollout relative
to the smallest size. Targets (issue 19, 2-core machine): 1M rollouts within 1.5x the floor and
under 3 GB peak RSS; cost per rollout flat (±30%) from 10k to 1M. ``--repeat K`` runs each K
times in turn and keeps the best (the machine is shared and noisy). Process CPU (user + system of
all threads, over the timed part) is printed beside wall time: on a loaded machine it is the steadier figure.
It is also the stricter one: credit compute writes on a second core while it computes the next
block (docs/credit.md §6), so its wall can match the floor's, which reads and writes on one.

``--data DIR`` keeps the generated inputs in ``DIR/N/`` and reuses them on the next run
(generating 1M rollouts takes minutes and ~4 GB). ``--baseline SRC`` also runs credit compute
from another source tree (a folder holding an older ``draco_cli``, e.g. from ``git archive``)
in turn with the current one, on the same inputs, and prints the A/B ratios.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402

GROUP = 8
STEPS = 20
CRITERIA = 6


def _lists(offsets: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=typ))


def make_inputs(n: int, folder: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ids = np.char.add("r", np.arange(n).astype(str))
    groups = np.char.add("g", (np.arange(n) // GROUP).astype(str))
    m = rng.integers(STEPS - 5, STEPS + 6, size=n)            # steps per rollout
    total = int(m.sum())
    step_row = np.repeat(np.arange(n), m)
    first = np.cumsum(m) - m
    step_no = np.arange(total) - first[step_row] + 1
    n_tok = rng.integers(50, 151, size=total).astype(np.int32)
    gap, obs = 10, 30
    # each step: 10 gap tokens, the step, then 30 observation tokens
    span_len = gap + n_tok + obs
    cum = np.cumsum(span_len) - span_len
    start_in_rollout = cum - cum[first][step_row]
    token_start = (start_in_rollout + gap).astype(np.int32)
    response_len = np.add.reduceat(span_len, first).astype(np.int32)
    spans = np.stack([token_start - gap, token_start + n_tok], axis=1).astype(np.int32)
    inner = _lists(np.arange(total + 1) * 2, spans.ravel(), pa.int32())
    policy_spans = pa.ListArray.from_arrays(pa.array(np.append(first, total).astype(np.int32)),
                                            inner)
    rollouts = pa.table({
        "rollout_id": ids, "group_id": groups, "task_id": groups,
        "instruction": pa.array(np.full(n, "do the task")),
        "outcome": rng.integers(0, 2, size=n).astype(np.float64),
        "n_turns": m.astype(np.int32), "response_len": response_len, "policy_spans": policy_spans,
    })
    steps = pa.table({
        "rollout_id": ids[step_row], "step": step_no.astype(np.int32),
        "action": pa.array(np.full(total, "")), "observation": pa.array(np.full(total, "")),
        "n_tokens": n_tok, "token_start": token_start,
    })
    nv = n * CRITERIA
    v_row = np.repeat(np.arange(n), CRITERIA)
    k = rng.integers(1, 4, size=nv)
    cites = (rng.random(int(k.sum())) * m[np.repeat(v_row, k)]).astype(np.int32) + 1
    verdicts = pa.table({
        "rollout_id": ids[v_row],
        "criterion_id": np.char.add("c", np.tile(np.arange(CRITERIA), n).astype(str)),
        "judge": pa.array(np.full(nv, "frontier")),
        "verdict": rng.choice(np.array(["pass", "fail", "na"]), size=nv, p=[0.6, 0.35, 0.05]),
        "cited_steps": _lists(np.append(0, np.cumsum(k)), cites, pa.int32()),
        "reason": pa.array(np.full(nv, "")),
    })
    folder.mkdir(parents=True, exist_ok=True)
    for name, t in (("rollouts", rollouts), ("steps", steps), ("verdicts", verdicts)):
        pq.write_table(t, folder / f"{name}.parquet", compression="zstd")


CHILD_CREDIT = """
import sys, time
from draco_cli._allocator import tune_allocator
tune_allocator()  # as the draco command does at start-up, before polars is loaded
try:
    from draco_cli.credit import credit_compute
except ImportError:  # a --baseline tree from before draco_cli/credit/
    from draco_cli.publish.credit import credit_compute
d, out = sys.argv[1], sys.argv[2]
t, c = time.perf_counter(), time.process_time()
credit_compute(f"{d}/rollouts.parquet", f"{d}/steps.parquet", f"{d}/verdicts.parquet",
               f"{d}/{out}", tokens="spans", force=True)
print(time.perf_counter() - t, time.process_time() - c)
"""

CHILD_FLOOR = """
import sys, time
import pyarrow.parquet as pq
d = sys.argv[1]
outs = {n: pq.read_table(f"{d}/out/{n}.parquet") for n in
        ("rewards", "step_credit", "token_advantages")}
t, c = time.perf_counter(), time.process_time()
for n in ("rollouts", "steps", "verdicts"):
    pq.read_table(f"{d}/{n}.parquet")
for n, tab in outs.items():
    pq.write_table(tab, f"{d}/floor_{n}.parquet", compression="zstd")
print(time.perf_counter() - t, time.process_time() - c)
"""


def timed_child(code: str, *args: str, source: str | None = None) -> tuple[float, float, float]:
    """(wall and CPU seconds (user + system, all threads) of the timed part, as the child
    prints them; its peak RSS in MiB), run in a fresh interpreter; ``source`` puts another ``draco_cli`` first on its path."""
    out, peak = run_child(code, *args, source=source)
    wall, cpu = (float(x) for x in out.split()[-2:])
    return wall, cpu, peak


def same_outputs(a: Path, b: Path) -> bool:
    """The three tables hold the same columns, types and values (the output-set id in the
    metadata differs by design)."""
    for name in ("rewards", "step_credit", "token_advantages"):
        ta, tb = (pq.read_table(x / f"{name}.parquet") for x in (a, b))
        ma, mb = ({k: v for k, v in (t.schema.metadata or {}).items()
                   if not k.startswith(b"draco.output_set")} for t in (ta, tb))
        if ma != mb or not ta.replace_schema_metadata().equals(tb.replace_schema_metadata()):
            print(f"  {name}: differs from the baseline's")
            return False
    return True


def _line(label: str, n: int, run: tuple[float, float, float]) -> str:
    secs, cpu, rss = run
    return (f"  {label:<14}: {secs:7.2f} s  cpu {cpu:7.2f} s  {n / secs:10.0f} rollouts/s  "
            f"peak RSS {rss:8.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each, in turn (credit, floor, credit, ...); the best counts")
    ap.add_argument("--data", type=Path, default=None,
                    help="keep generated inputs here (DIR/N/) and reuse them")
    ap.add_argument("--baseline", default=None,
                    help="source tree of an older draco_cli to A/B against, in turn")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-credit-"))
    per_rollout = {}
    try:
        for n in sizes:
            d = (args.data or tmp) / str(n)
            t0 = time.perf_counter()
            if not (d / "verdicts.parquet").exists():
                make_inputs(n, d)
            gen = time.perf_counter() - t0
            runs, base_runs, floor_runs = [], [], []
            for _ in range(args.repeat):  # in turn, so load changes hit all alike
                if args.baseline:
                    base_runs.append(timed_child(CHILD_CREDIT, str(d), "out_baseline",
                                                  source=args.baseline))
                runs.append(timed_child(CHILD_CREDIT, str(d), "out"))
                floor_runs.append(timed_child(CHILD_FLOOR, str(d)))
            best = min(runs)
            floor = min(floor_runs)
            per_rollout[n] = best[0] / n
            in_mb = sum((d / f"{x}.parquet").stat().st_size for x in
                        ("rollouts", "steps", "verdicts")) / 2**20
            out_mb = sum(p.stat().st_size for p in (d / "out").glob("*.parquet")) / 2**20
            print(f"N={n:>8}  inputs {in_mb:7.1f} MiB, outputs {out_mb:7.1f} MiB "
                  f"(inputs ready in {gen:.1f}s)")
            if base_runs:
                print(_line("baseline", n, min(base_runs)))
            print(_line("credit compute", n, best))
            print(_line("I/O floor", n, floor))
            print(f"  ratio to floor: {best[0] / floor[0]:.2f}x wall, "
                  f"{min(c for _, c, _ in runs) / min(c for _, c, _ in floor_runs):.2f}x cpu;  "
                  f"cost per rollout vs N={sizes[0]}: {per_rollout[n] / per_rollout[sizes[0]]:.2f}x")
            if base_runs:
                b = min(base_runs)
                print(f"  vs baseline   : {best[0] / b[0]:.2f}x wall, "
                      f"{min(c for _, c, _ in runs) / min(c for _, c, _ in base_runs):.2f}x cpu, "
                      f"{best[2] / b[2]:.2f}x peak RSS")
            for label, group in (("baseline", base_runs), ("credit", runs), ("floor", floor_runs)):
                for k, (w, c, m) in enumerate(group):
                    print(f"    {label} run {k + 1}: wall {w:.2f} s, cpu {c:.2f} s, "
                          f"peak {m:.0f} MiB")
            if base_runs:
                print(f"  outputs equal to the baseline's: {same_outputs(d / 'out', d / 'out_baseline')}")
            if args.data is None:
                shutil.rmtree(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
