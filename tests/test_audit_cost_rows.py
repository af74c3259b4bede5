"""`draco audit cost` reads only the cost columns of a call log, in batches, typed."""

from __future__ import annotations

import json
import sqlite3

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from draco_cli.audit import AUDIT_COST_COLUMNS, billed_vs_naive, cost_audit, read_cost_rows
from draco_cli.llm.calllog import CallLog
from tests.conftest import run_draco


def read_calls(path) -> pl.DataFrame:
    """Every column of a call log, read whole: the reference the column-reading is held to."""
    with sqlite3.connect(path) as conn:
        cur = conn.execute("SELECT * FROM calls")
        names = [d[0] for d in cur.description]
        return pl.DataFrame(cur.fetchall(), schema=names, orient="row", infer_schema_length=None)


def _log(path, n: int) -> None:
    with CallLog(path) as log:
        for i in range(n):
            for sample in range(1 + (i % 4 == 0)):  # a reply with n=2 is two rows
                log.record(request_hash=f"h{i}", sample=sample, phase=["score", "merge"][i % 2],
                           key=f"r{i // 2}", provider="openai", model="gpt-4.1",
                           status=["ok", "ok", "http_error", "invalid"][i % 4],
                           request="p" * 500, response=json.dumps({"id": i}),
                           input_tokens=100 + i, cached_tokens=None if i % 3 else 7,
                           output_tokens=i % 50, cost_usd=0.001 * i,
                           batch_id="b" if i % 5 == 0 else None)


def test_cost_rows_give_the_tables_every_column_gives(tmp_path):
    _log(tmp_path / "c.sqlite", 3000)  # several fetch batches
    rollouts = pl.DataFrame({"rollout_id": [f"r{i}" for i in range(1500)],
                             "group_id": "g", "train_step": [i % 3 for i in range(1500)]})
    every = read_calls(tmp_path / "c.sqlite")
    every.write_parquet(tmp_path / "c.parquet", row_group_size=700)
    for source in (tmp_path / "c.sqlite", tmp_path / "c.parquet"):
        rows = read_cost_rows(source, AUDIT_COST_COLUMNS)
        assert "request" not in rows.columns and "response" not in rows.columns
        for a, b in zip(cost_audit(every, rollouts)[:2], cost_audit(rows, rollouts)[:2]):
            assert_frame_equal(a, b, check_dtypes=False)  # typed: an all-null column too
        assert_frame_equal(billed_vs_naive(every), billed_vs_naive(rows))


def test_empty_log_is_an_empty_audit(tmp_path):
    with CallLog(tmp_path / "c.sqlite"):
        pass
    rows = read_cost_rows(tmp_path / "c.sqlite", AUDIT_COST_COLUMNS)
    assert rows.height == 0 and rows.schema["input_tokens"] == pl.Int64
    pl.DataFrame({"rollout_id": ["r"], "group_id": ["g"], "task_id": ["t"],
                  "train_step": [0]}).write_parquet(tmp_path / "r.parquet")
    res = run_draco("audit", "cost", "--calls", str(tmp_path / "c.sqlite"), "--rollouts",
                    str(tmp_path / "r.parquet"), "-o", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr
    assert pl.read_parquet(tmp_path / "a" / "cost_phase.parquet").height == 0


def test_a_non_numeric_token_count_names_file_and_column(tmp_path):
    _log(tmp_path / "c.sqlite", 4)
    with sqlite3.connect(tmp_path / "c.sqlite") as conn:
        conn.execute("UPDATE calls SET output_tokens = 'many' WHERE rowid = 2")
    res = run_draco("audit", "cost", "--calls", str(tmp_path / "c.sqlite"), "-o",
                    str(tmp_path / "a"))
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert "c.sqlite" in err and "output_tokens" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("n", [0, 5])
def test_parquet_export_without_response_column(tmp_path, n):
    _log(tmp_path / "c.sqlite", n)
    every = read_calls(tmp_path / "c.sqlite")
    if n:
        every.drop("response").write_parquet(tmp_path / "c.parquet")
        rows = read_cost_rows(tmp_path / "c.parquet", AUDIT_COST_COLUMNS)
        assert rows.height == every.height and rows["call_key"].null_count() == rows.height
