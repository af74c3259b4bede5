"""judge.raw_frame builds the raw verdict table column by column: the same table polars builds
from the rows."""

from __future__ import annotations

import random

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from draco_cli.judge.core import RAW_SCHEMA, raw_frame


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"rollout_id": f"r{i // 6}", "criterion_id": f"c{i % 6}", "judge": "j",
             "sample": rng.randint(0, 3),
             "verdict": rng.choice(["pass", "fail", "na", None]),
             "cited_steps": sorted(rng.sample(range(1, 40), rng.randint(0, 5))),
             "reason": rng.choice(["why", "", "criterion missing from the judge's answer",
                                   "ünïcode ✓"])} for i in range(n)]


@pytest.mark.parametrize(("n", "seed"), [(0, 0), (1, 1), (7, 2), (5000, 3)])
def test_raw_frame_equals_the_row_wise_table(n, seed):
    rows = _rows(n, seed)
    got = raw_frame(rows)
    assert got.schema == pl.Schema(RAW_SCHEMA)
    assert_frame_equal(got, pl.DataFrame(rows, schema=RAW_SCHEMA))


def test_every_list_empty():
    rows = [dict(r, cited_steps=[]) for r in _rows(9, 4)]
    assert_frame_equal(raw_frame(rows), pl.DataFrame(rows, schema=RAW_SCHEMA))
