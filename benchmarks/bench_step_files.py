"""The file routes over a long run: a trainer (verl's ``DRACO_TOKEN_ADVANTAGES`` glob, slime's
``draco_token_advantages`` folder) that reads each batch's advantages from a growing set of
step files, ``AdvantageFiles.load``, against the floor of reading the batch's own step file
alone (``load_token_advantages`` on that one file).

    python benchmarks/bench_step_files.py [--steps 80] [--rollouts 1024] [--tokens 512]

Writes ``--steps`` files of ``--rollouts`` rollouts (dense advantages of ``--tokens`` tokens
each), then runs one batch per step, each batch the rollouts of the newest file so far, and
prints the last step's seconds and the bytes of the tables held after it. Last line:
``last_step_over_floor=<ratio> held_mib=<MiB>``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draco_cli.trainers.loader import AdvantageFiles, load_token_advantages


def write_step(path: Path, step: int, n: int, tokens: int) -> list[str]:
    ids = [f"s{step}-r{i}" for i in range(n)]
    values = np.random.default_rng(step).normal(size=(n, tokens)).astype(np.float32)
    pq.write_table(pa.table({
        "rollout_id": pa.array(ids, pa.string()),
        "length": pa.array([tokens] * n, pa.int32()),
        "advantages": pa.array(list(values), pa.list_(pa.float32()))}), path)
    return ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rollouts", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files: list[str] = []
        reader = AdvantageFiles()
        for step in range(a.steps):
            f = Path(tmp) / f"step-{step:06d}.parquet"
            ids = write_step(f, step, a.rollouts, a.tokens)
            files.append(str(f))
            t = time.perf_counter()
            reader.load(files, ids)
            last = time.perf_counter() - t
        t = time.perf_counter()
        load_token_advantages(files[-1], rollout_ids=ids)
        floor = time.perf_counter() - t
        held = sum(t.nbytes for t in reader._tables.values()) / 2**20
    print(f"{a.steps} step files of {a.rollouts} rollouts x {a.tokens} tokens")
    print(f"  AdvantageFiles.load, last step : {last:.4f} s (tables held: {held:.1f} MiB)")
    print(f"  the batch's own file alone     : {floor:.4f} s")
    print(f"last_step_over_floor={last / floor:.2f} held_mib={held:.1f}")


if __name__ == "__main__":
    main()
