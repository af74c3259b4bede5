"""draco_cli.trainer on arrays shaped as verl, TRL and OpenRLHF shape them."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import polars as pl
import pytest

from draco_cli.io import write_table
from draco_cli.schemas import TokenAdvantages
from draco_cli.token_advantages import spans_to_dense
from draco_cli.trainer import AlignmentError, group_rollout_ids, load_token_advantages


@pytest.fixture
def table(tmp_path):
    spans = pl.DataFrame({
        "rollout_id": ["u1:0", "u1:1", "u2:0"], "length": [6, 4, 3],
        "layout": ["positions"] * 3,
        "span_start": [[1, 4], [0], []], "span_end": [[3, 5], [2], []],
        "span_value": [[0.5, -1.0], [2.0], []],
    }, schema_overrides={"length": pl.Int32, "span_start": pl.List(pl.Int32),
                         "span_end": pl.List(pl.Int32), "span_value": pl.List(pl.Float32)})
    write_table(spans, tmp_path / "spans.parquet", TokenAdvantages, drop_absent_optional=True)
    write_table(spans_to_dense(spans), tmp_path / "dense.parquet", TokenAdvantages,
                drop_absent_optional=True)
    return tmp_path


@pytest.mark.parametrize("form", ["spans", "dense"])
def test_verl_batch_keyed_by_uid(table, form):
    t = load_token_advantages(table / f"{form}.parquet")
    # verl: non_tensor_batch["uid"] is an object array, one group id per row, rows of a group
    # in rollout order; response_mask is [bs, response_length], right-padded.
    uid = np.array(["u1", "u2", "u1"], dtype=object)
    ids = group_rollout_ids(uid)
    assert ids == ["u1:0", "u2:0", "u1:1"]
    mask = np.array([[1, 1, 1, 0, 1, 1, 0, 0],
                     [1, 1, 1, 0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 0, 0, 0, 0]], dtype=np.int64)
    adv = t.batch(ids, mask)
    assert adv.dtype == np.float32 and adv.shape == (3, 8)
    np.testing.assert_array_equal(adv[0], [0, 0.5, 0.5, 0, -1.0, 0, 0, 0])
    np.testing.assert_array_equal(adv[1], np.zeros(8))
    np.testing.assert_array_equal(adv[2], [2.0, 2.0, 0, 0, 0, 0, 0, 0])


def test_trl_and_openrlhf_shapes(table):
    t = load_token_advantages(table / "spans.parquet", rollout_ids=["u1:0"])
    assert len(t) == 1
    # TRL completion_mask / OpenRLHF action_mask: [B, max_completion_len], right-padded
    completion_mask = np.ones((1, 5), dtype=np.int32)
    adv = t.batch(["u1:0"], completion_mask)
    np.testing.assert_array_equal(adv[0], [0, 0.5, 0.5, 0, -1.0])


def test_misalignment_is_caught(table):
    t = load_token_advantages(table / "spans.parquet")
    with pytest.raises(AlignmentError, match="past the trainer's 4 response tokens"):
        t.batch(["u1:0"], length=4)
    with pytest.raises(AlignmentError, match="the response mask excludes"):
        t.batch(["u1:0"], np.array([[1, 0, 1, 1, 1, 1]]))
    with pytest.raises(AlignmentError, match="no token advantages for rollout 'nope'"):
        t.batch(["nope"], length=4)
    # non-strict: cut and masked silently
    adv = t.batch(["u1:0"], np.array([[1, 0, 1, 1]]), strict=False)
    np.testing.assert_array_equal(adv[0], [0, 0, 0.5, 0])


def test_trainer_module_imports_no_torch_and_no_polars():
    code = ("import sys, draco_cli.trainer; "
            "print(any(m in sys.modules for m in ('torch', 'polars', 'typer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
