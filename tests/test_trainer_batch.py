"""TokenAdvantageTable.batch (whole-batch numpy) against a per-row reference on random data."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from draco_cli.io import write_table
from draco_cli.schemas import TokenAdvantages
from draco_cli.credit.tokens import spans_to_dense
from draco_cli.trainers.loader import AlignmentError, fingerprint, load_token_advantages


def _random_file(rng, R):
    rows = []
    for r in range(R):
        length = int(rng.integers(0, 12))
        cuts = np.unique(rng.integers(0, length + 1, size=int(rng.integers(0, 7))))
        starts, ends, values = [], [], []
        for s, e in zip(cuts[:-1], cuts[1:]):
            if rng.random() < 0.6:
                starts.append(int(s))
                ends.append(int(e))
                values.append(float(rng.choice([-1.5, 0.25, 2.0])))
        # canonical spans: merge touching spans of equal value
        merged = []
        for s, e, v in zip(starts, ends, values):
            if merged and merged[-1][1] == s and merged[-1][2] == v:
                merged[-1][1] = e
            else:
                merged.append([s, e, v])
        rows.append({"rollout_id": f"r{r}", "length": length, "layout": "positions",
                     "span_start": [m[0] for m in merged], "span_end": [m[1] for m in merged],
                     "span_value": [m[2] for m in merged]})
    return pl.DataFrame(rows, schema_overrides={
        "length": pl.Int32, "span_start": pl.List(pl.Int32), "span_end": pl.List(pl.Int32),
        "span_value": pl.List(pl.Float32)})


def _reference(df, ids, T, mask, pad):
    by_id = {r["rollout_id"]: r for r in df.iter_rows(named=True)}
    out = np.zeros((len(ids), T), dtype=np.float32)
    for b, rid in enumerate(ids):
        if pad[b]:
            continue
        r = by_id[rid]
        for s, e, v in zip(r["span_start"], r["span_end"], r["span_value"]):
            out[b, s:min(e, T)] = v
    return out * (mask != 0) if mask is not None else out


@pytest.mark.parametrize("form", ["spans", "dense"])
@pytest.mark.parametrize("seed", range(6))
def test_batch_equals_per_row_reference(tmp_path, form, seed):
    rng = np.random.default_rng(seed)
    df = _random_file(rng, 40)
    write_table(df if form == "spans" else spans_to_dense(df), tmp_path / "ta.parquet",
                TokenAdvantages, drop_absent_optional=True)
    table = load_token_advantages(tmp_path / "ta.parquet")
    B = 60
    ids = [f"r{int(i)}" for i in rng.integers(0, 40, size=B)]
    pad = rng.random(B) < 0.1
    for T in (4, 12, 15):
        ref = _reference(df, ids, T, None, pad)
        fits = all(not ref_row_past(df, rid, T) for rid, p in zip(ids, pad) if not p)
        if fits:
            np.testing.assert_array_equal(table.batch(ids, length=T, padding=pad), ref)
        else:
            with pytest.raises(AlignmentError, match="past the trainer's"):
                table.batch(ids, length=T, padding=pad)
        # a mask that covers every span exactly as the reference does
        mask = (rng.random((B, T)) < 0.5).astype(np.int64)
        np.testing.assert_array_equal(table.batch(ids, mask, padding=pad, strict=False),
                                      _reference(df, ids, T, mask, pad))
        full = np.ones((B, T), dtype=np.int8)
        if fits:
            np.testing.assert_array_equal(table.batch(ids, full, padding=pad), ref)


def ref_row_past(df, rid, T):
    r = df.filter(pl.col("rollout_id") == rid).row(0, named=True)
    return any(e > T for e in r["span_end"])


def test_first_failing_row_is_reported_with_its_first_failing_check(tmp_path):
    ids = {"a": [1, 2, 3], "b": [4, 5, 6]}
    df = pl.DataFrame({
        "rollout_id": ["a", "b"], "length": [3, 3], "layout": ["positions"] * 2,
        "span_start": [[0], [1]], "span_end": [[3], [3]], "span_value": [[1.0], [2.0]],
        "train_step": [5, 5], "n_policy_tokens": [3, 2],
        "response_fingerprint": [fingerprint(ids["a"]), fingerprint(ids["b"])],
    }, schema_overrides={"length": pl.Int32, "span_start": pl.List(pl.Int32),
                         "span_end": pl.List(pl.Int32), "span_value": pl.List(pl.Float32),
                         "train_step": pl.Int32, "n_policy_tokens": pl.Int32})
    write_table(df, tmp_path / "ta.parquet", TokenAdvantages, drop_absent_optional=True)
    t = load_token_advantages(tmp_path / "ta.parquet")
    mask = np.array([[1, 1, 1], [0, 1, 1]])
    resp = np.array([ids["a"], ids["b"]])
    t.batch(["a", "b"], mask, train_step=5, response_ids=resp)
    # row 1 has a wrong step and a wrong fingerprint: the step is reported
    with pytest.raises(AlignmentError, match=r"'b' \(trainer row 1\): the file is from train"):
        t.batch(["a", "b"], mask, train_step=[5, 6], response_ids=np.array([ids["a"], [9] * 3]))
    # row 0's fingerprint fails before row 1's step
    with pytest.raises(AlignmentError, match=r"'b' \(trainer row 0\).*fingerprint"):
        t.batch(["b", "b"], np.array([[0, 1, 1], [0, 1, 1]]), train_step=[5, 6],
                response_ids=np.array([[9] * 3, ids["b"]]))
    # counts right but a span on a masked token
    with pytest.raises(AlignmentError, match=r"'b' \(trainer row 1\): advantages on 1 tokens"):
        t.batch(["a", "b"], np.array([[1, 1, 1], [1, 0, 1]]))
