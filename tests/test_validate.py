from __future__ import annotations

import polars as pl
import pytest

from draco_cli.errors import InputError
from draco_cli.io import read_table, write_table
from draco_cli.schemas import Rollout, Step
from draco_cli.validate.folder import validate_paths


def rollouts(**over):
    base = {
        "rollout_id": ["a", "b"], "group_id": ["g", "g"], "task_id": ["t", "t"],
        "instruction": ["i", "i"], "n_turns": [2, 1], "response_len": [30, 10],
        "policy_spans": [[[0, 10], [20, 30]], [[0, 10]]],
    }
    base.update(over)
    return pl.DataFrame(base)


def steps(**over):
    base = {
        "rollout_id": ["a", "a", "b"], "step": [1, 2, 1], "action": ["x", "y", "z"],
        "observation": ["", "", ""], "n_tokens": [10, 10, 10], "token_start": [0, 20, 0],
    }
    base.update(over)
    return pl.DataFrame(base)


def check(tmp_path, r, s):
    write_table(r, tmp_path / "rollouts.parquet", Rollout, force=True)
    write_table(s, tmp_path / "steps.parquet", Step, force=True)
    return validate_paths([tmp_path / "rollouts.parquet", tmp_path / "steps.parquet"])


def test_valid_pair(tmp_path):
    counts, problems = check(tmp_path, rollouts(), steps())
    assert problems == [] and counts == {"rollouts": 2, "steps": 3}


@pytest.mark.parametrize("r,s,expected", [
    (rollouts(), steps(step=[1, 3, 1]), "row 1: field 'step': steps of a rollout must run"),
    (rollouts(), steps(rollout_id=["a", "a", "zz"]), "row 2: field 'rollout_id': no such rollout"),
    (rollouts(), steps(token_start=[0, 25, 0]), "row 1: field 'token_start': step tokens end past"),
    (rollouts(), steps(token_start=[0, 5, 0]), "field 'token_start': step tokens outside the rollout's policy_spans"),
    (rollouts(policy_spans=[[[0, 10], [5, 30]], [[0, 10]]]), steps(),
     "row 0: field 'policy_spans': spans overlap"),
    (rollouts(policy_spans=[[[0, 10], [20, 40]], [[0, 10]]]), steps(),
     "row 0: field 'policy_spans': span ends past response_len"),
    (rollouts(group_id=["g", "h"]), steps(), "task 't' at train_step None is split over groups ['g', 'h']"),
])
def test_problems_are_found(tmp_path, r, s, expected):
    _, problems = check(tmp_path, r, s)
    assert any(expected in p for p in problems), problems


def test_overlapping_steps(tmp_path):
    r = rollouts(policy_spans=[[[0, 30]], [[0, 10]]])
    _, problems = check(tmp_path, r, steps(token_start=[0, 5, 0]))
    assert any("step token ranges overlap" in p for p in problems), problems


@pytest.mark.parametrize("frame,message", [
    (steps(n_tokens=[10, 0, 10]), r"steps\.parquet: row 1: field 'n_tokens': must be >= 1, got 0"),
    (steps(step=[1, 1, 1]), r"row 1: field '\(rollout_id, step\)': duplicate key \(rollout_id='a', step=1\)"),
    (steps().drop("action"), r"field 'action': missing required column of table 'steps'"),
    (steps(action=["x", None, "z"]), r"row 1: field 'action': must not be null"),
    (steps(n_tokens=["10", "ten", "3"]), r"row 1: field 'n_tokens': expected int32, got String \(value 'ten'\)"),
])
def test_read_errors_name_file_row_field(tmp_path, frame, message):
    path = tmp_path / "steps.parquet"
    frame.write_parquet(path)
    with pytest.raises(InputError, match=message):
        read_table(path, Step)


def test_enum_checked(tmp_path):
    path = tmp_path / "rollouts.parquet"
    rollouts(termination=["submitted", "exploded"]).write_parquet(path)
    with pytest.raises(InputError, match=r"row 1: field 'termination': 'exploded' is not one of"):
        read_table(path, Rollout)


def test_unknown_table_and_missing_file(tmp_path):
    (tmp_path / "mystery.parquet").write_bytes(b"")
    pl.DataFrame({"x": [1]}).write_parquet(tmp_path / "mystery.parquet")
    _, problems = validate_paths([tmp_path / "mystery.parquet", tmp_path / "nope.parquet"])
    assert "cannot tell which table" in problems[0]
    assert "nope.parquet: no such file" in problems[1]


# --- the checks shared by validate and the commands --------------------------------------

import pyarrow as pa  # noqa: E402

from draco_cli.validate import policy_span_issues, token_advantage_issues  # noqa: E402

SPANS = pa.list_(pa.list_(pa.int32()))


@pytest.mark.parametrize("spans,resp,expected", [
    ([[[0, 5], [7, 9]], None, [[0, 3]]], [9, None, 3], []),
    ([[[0, 5], [4, 9]]], [9], ["spans overlap or are out of order"]),
    ([[[7, 9], [0, 5]]], [9], ["spans overlap or are out of order"]),
    ([[[0, 5, 6]]], [9], ["a span must be a [start, end) pair"]),
    ([[[0, None]]], [9], ["a span bound is null"]),
    ([[[-1, 5]]], [9], ["span with start < 0 or end <= start"]),
    ([[[3, 3]]], [9], ["span with start < 0 or end <= start"]),
    ([[[0, 10]]], [9], ["span ends past response_len"]),
])
def test_policy_span_rules(spans, resp, expected):
    issues = policy_span_issues(pa.array(spans, type=SPANS), pl.Series(resp, dtype=pl.Int32))
    assert [what for _, _, what in issues] == expected


def test_policy_spans_of_the_wrong_type():
    issues = policy_span_issues(pa.array([[1, 2]], type=pa.list_(pa.int64())))
    assert issues and "expected list<list<int32>>" in issues[0][2]


def ta(**over):
    base = {"rollout_id": ["a", "b"], "length": [10, 4], "layout": ["positions"] * 2,
            "span_start": [[0, 5], [1]], "span_end": [[3, 8], [4]],
            "span_value": [[0.5, -1.0], [2.0]]}
    base.update(over)
    return pl.DataFrame(base, schema_overrides={"span_start": pl.List(pl.Int32),
                                                "span_end": pl.List(pl.Int32),
                                                "span_value": pl.List(pl.Float32)})


@pytest.mark.parametrize("frame,expected", [
    (ta(), []),
    (ta(span_end=[[3, 11], [4]]), [("span_start", [0], "span outside 0..length, or empty")]),
    (ta(span_start=[[0, 2], [1]]), [("span_start", [0], "token spans overlap or are out of order")]),
    (ta(span_value=[[0.5], [2.0]]),
     [("span_start", [0], "span_start, span_end and span_value differ in length")]),
    (ta().with_columns(pl.Series("advantages", [[0.0] * 10, [0.0] * 3], dtype=pl.List(pl.Float32))),
     [("advantages", [1], "holds a different number of values than length")]),
])
def test_token_advantage_rules(frame, expected):
    got = [(field, rows, what) for field, (rows, _, what) in token_advantage_issues(frame)]
    assert got == expected
