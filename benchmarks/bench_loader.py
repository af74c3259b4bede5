"""Trainer-side loader: spans in token_advantages.parquet → the trainer's padded [B, T] tensor.

    python benchmarks/bench_loader.py [--rollouts 100000] [--tokens 1024] [--repeat 3]

Builds a synthetic spans file (each rollout: up to 8 turns of policy tokens, one span of one
value each, separated by observation tokens; length uniform in T/4..T) with n_policy_tokens,
train_step and response_fingerprint, and the trainer's inputs: a shuffled batch of row ids,
an int64 right-padded response_mask [B, T] (verl's dtype) and int64 response ids [B, T].
Then, in this process, best of ``--repeat``:
- **loader**: ``TokenAdvantageTable.batch(ids, mask, train_step=..., response_ids=...)``,
  every check on (ids, train step, mask counts, fingerprints, masked tokens, past T);
- **loader without fingerprints**: the same without ``response_ids``;
- **baseline**: a plain numpy broadcast of per-rollout values over the mask,
  ``adv[:, None] * mask`` (what verl's own GRPO does to make its padded tensor).
Prints seconds and the ratios loader / baseline. Target: ≤ 1.2× (issue 19).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draco_cli.trainers.loader import fingerprint, load_token_advantages

TURNS = 8


def build(B: int, T: int, folder: Path, seed: int = 0):
    rng = np.random.default_rng(seed)
    length = rng.integers(T // 4, T + 1, size=B)
    # cut each response into TURNS turns; in each turn 2/3 policy tokens, then observation
    cuts = np.sort(rng.integers(0, length[:, None], size=(B, TURNS - 1)), axis=1)
    bounds = np.concatenate([np.zeros((B, 1), np.int64), cuts, length[:, None]], axis=1)
    t0, t1 = bounds[:, :-1], bounds[:, 1:]
    pol_end = t0 + (2 * (t1 - t0) + 2) // 3
    keep = pol_end > t0
    start, end = t0[keep], pol_end[keep]
    rows = np.repeat(np.arange(B), TURNS).reshape(B, TURNS)[keep]
    value = rng.standard_normal(start.size).astype(np.float32)
    value[value == 0] = 1.0
    n_spans = keep.sum(axis=1)
    offsets = np.zeros(B + 1, dtype=np.int32)
    np.cumsum(n_spans, out=offsets[1:])
    mask = np.zeros((B, T), dtype=np.int64)
    span_len = end - start
    flat = np.repeat(rows * T + start - (np.cumsum(span_len) - span_len), span_len) \
        + np.arange(int(span_len.sum()))
    mask.reshape(-1)[flat] = 1
    resp = rng.integers(0, 150_000, size=(B, T), dtype=np.int64)
    resp[np.arange(T)[None, :] >= length[:, None]] = 0  # right padding
    ids = np.char.add("r", np.arange(B).astype(str))
    lists = lambda v, t: pa.ListArray.from_arrays(pa.array(offsets), pa.array(v, type=t))  # noqa: E731
    table = pa.table({
        "rollout_id": ids, "length": length.astype(np.int32),
        "layout": pa.array(np.full(B, "positions")),
        "span_start": lists(start, pa.int32()), "span_end": lists(end, pa.int32()),
        "span_value": lists(value, pa.float32()),
        "n_policy_tokens": mask.sum(axis=1).astype(np.int32),
        "train_step": np.full(B, 7, dtype=np.int32),
        "response_fingerprint": [fingerprint(resp[b, :length[b]]) for b in range(B)],
    })
    pq.write_table(table, folder / "token_advantages.parquet", compression="zstd")
    # the trainer's batch arrives reordered (verl's balance_batch)
    order = rng.permutation(B)
    per_rollout = rng.standard_normal(B).astype(np.float32)
    return ids[order].tolist(), mask[order], resp[order], per_rollout


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        out = None
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    B, T = a.rollouts, a.tokens
    with tempfile.TemporaryDirectory(prefix="draco-bench-loader-") as tmp:
        t = time.perf_counter()
        ids, mask, resp, per_rollout = build(B, T, Path(tmp))
        print(f"B={B} rollouts x T={T} tokens; inputs built in {time.perf_counter() - t:.1f}s")
        t = time.perf_counter()
        table = load_token_advantages(Path(tmp) / "token_advantages.parquet")
        print(f"  load_token_advantages        : {time.perf_counter() - t:6.3f} s (once)")
    base, ref = best(lambda: per_rollout[:, None] * mask.astype(np.float32, copy=False)
                     if mask.dtype == np.float32 else per_rollout[:, None] * mask, a.repeat)
    del ref
    full, out = best(lambda: table.batch(ids, mask, train_step=7, response_ids=resp), a.repeat)
    assert out.shape == (B, T) and out.dtype == np.float32
    assert int(np.count_nonzero(out)) == int(mask.sum())  # every policy token got its value
    del out
    nofp, _ = best(lambda: table.batch(ids, mask, train_step=7), a.repeat)
    print(f"  baseline adv[:, None] * mask : {base:6.3f} s")
    print(f"  loader, every check          : {full:6.3f} s   ratio {full / base:.2f}x")
    print(f"  loader, no fingerprints      : {nofp:6.3f} s   ratio {nofp / base:.2f}x")


if __name__ == "__main__":
    main()
