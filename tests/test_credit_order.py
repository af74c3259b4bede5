"""credit compute gives the same tables whether steps and verdicts come in the rollouts'
order (the fast path: ids mapped by runs, no string join) or shuffled (the join path)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
from polars.testing import assert_frame_equal

from draco_cli.credit import credit_compute

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_credit import make_inputs  # noqa: E402


def test_shuffled_inputs_give_the_same_outputs(tmp_path):
    make_inputs(300, tmp_path / "in", seed=3)
    rng = np.random.default_rng(0)
    for name in ("steps", "verdicts"):
        t = pq.read_table(tmp_path / "in" / f"{name}.parquet")
        pq.write_table(t.take(rng.permutation(t.num_rows)), tmp_path / "in" / f"{name}_x.parquet")
    d = tmp_path / "in"
    a = credit_compute(d / "rollouts.parquet", d / "steps.parquet", d / "verdicts.parquet",
                       tmp_path / "a")
    b = credit_compute(d / "rollouts.parquet", d / "steps_x.parquet", d / "verdicts_x.parquet",
                       tmp_path / "b")
    assert a == b
    for name in ("rewards", "step_credit", "token_advantages"):
        assert_frame_equal(pl.read_parquet(tmp_path / "a" / f"{name}.parquet"),
                           pl.read_parquet(tmp_path / "b" / f"{name}.parquet"))
