"""``draco ingest agentprocessbench``: rollouts, steps and the human step labels in one pass."""

from __future__ import annotations

import json

import polars as pl
import pytest

from draco_cli.errors import InputError
from draco_cli.ingest import ingest
from tests.conftest import APB_HOTPOT, run_draco, write_jsonl


def _row(**over):
    row = {
        "data_source": "src", "query_index": 3, "sample_index": 1, "question": "Who?",
        "answer_text": "Bob", "final_label": -1,
        "messages": [
            {"role": "system", "content": "be good"},
            {"role": "user", "content": "Who? use search"},
            {"role": "assistant", "content": "let me look",
             "tool_calls": "[{'id': 'c1', 'type': 'function', 'function': "
                           "{'name': 'search', 'arguments': '{\"q\": \"who\"}'}}]"},
            {"role": "tool", "tool_call_id": "c1", "content": "Alice"},
            {"role": "assistant", "content": "thinking more", "tool_calls": None},
            {"role": "assistant", "content": "<answer>Bob</answer>"},
        ],
        "step_labels": {"5": -1, "2": 1, "4": 0},
    }
    row.update(over)
    return row


def test_message_index_keys_map_to_step_numbers(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [_row(), _row(sample_index=2, final_label=1,
                                                        step_labels={"2": -1})])
    res = ingest("agentprocessbench", [src], tmp_path / "o")
    assert res.labels == 4 and res.manifest["step_labels"] == 4
    r = pl.read_parquet(tmp_path / "o" / "rollouts.parquet")
    assert r["rollout_id"].to_list() == ["src:3:1", "src:3:2"]
    assert r["group_id"].to_list() == ["src:3", "src:3"]
    assert r["outcome"].to_list() == [0.0, 1.0]
    assert r["instruction"].to_list() == ["Who?", "Who?"]
    s = pl.read_parquet(tmp_path / "o" / "steps.parquet").filter(pl.col("rollout_id") == "src:3:1")
    # step k = the k-th assistant message; the tool call written as a Python-style string
    assert s["step"].to_list() == [1, 2, 3]
    assert 'search({"q": "who"})' in s["action"][0] and "Alice" in s["observation"][0]
    assert s["action"][2] == "<answer>Bob</answer>"
    lab = pl.read_parquet(tmp_path / "o" / "step_labels.parquet").sort("rollout_id", "step")
    # message 2 -> step 1, message 4 -> step 2, message 5 -> step 3
    assert lab.select("rollout_id", "step", "label").rows() == [
        ("src:3:1", 1, 1), ("src:3:1", 2, 0), ("src:3:1", 3, -1), ("src:3:2", 1, -1)]
    assert set(lab["labeler"]) == {"human"}


@pytest.mark.parametrize("labels, field, words", [
    ({"3": 1}, "step_labels['3']", "tool message"),
    ({"9": 1}, "step_labels['9']", "no such message"),
    ({"2": 2}, "step_labels['2']", "not one of -1, 0, 1"),
    ({"x": 1}, "step_labels['x']", "not an integer"),
])
def test_bad_labels_name_file_row_and_field(tmp_path, labels, field, words):
    src = write_jsonl(tmp_path / "a.jsonl", [_row(), _row(sample_index=5, step_labels=labels)])
    with pytest.raises(InputError) as e:
        ingest("agentprocessbench", [src], tmp_path / "o")
    msg = str(e.value)
    assert "a.jsonl" in msg and "line 2" in msg and field in msg and words in msg
    p = run_draco("ingest", "agentprocessbench", str(src), "-o", str(tmp_path / "c"))
    assert p.returncode == 1 and b"Traceback" not in p.stderr
    assert len(p.stderr.decode().strip().splitlines()) == 1


def test_step_unit_other_than_message_is_refused(tmp_path):
    p = run_draco("ingest", "agentprocessbench", str(write_jsonl(tmp_path / "a.jsonl", [_row()])),
                  "--step-unit", "tool-call", "-o", str(tmp_path / "o"))
    assert p.returncode == 2 and b"step unit is message" in p.stderr


def test_hotpotqa_ingests_with_every_label_on_its_step(tmp_path):
    p = run_draco("ingest", "agentprocessbench", str(APB_HOTPOT), "-o", str(tmp_path))
    assert p.returncode == 0, p.stderr
    raw = [json.loads(line) for line in APB_HOTPOT.open()]
    r = pl.read_parquet(tmp_path / "rollouts.parquet")
    s = pl.read_parquet(tmp_path / "steps.parquet")
    lab = pl.read_parquet(tmp_path / "step_labels.parquet")
    assert r.height == 250 and r["group_id"].n_unique() == 50
    assert set(r.group_by("group_id").len()["len"]) == {5}
    assert int(r["outcome"].sum()) == sum(x["final_label"] == 1 for x in raw) == 163
    assert lab.height == 734 and lab["label"].value_counts().sort("label").rows() == [
        (-1, 179), (0, 56), (1, 499)]
    # independent mapping: the k-th assistant message's index -> step k, its text the action
    steps = {(a, b): c for a, b, c in s.select("rollout_id", "step", "action").iter_rows()}
    labels = {(a, b): c for a, b, c in lab.select("rollout_id", "step", "label").iter_rows()}
    mixed = 0
    for x in raw:
        rid = f"{x['data_source']}:{x['query_index']}:{x['sample_index']}"
        assistant = [i for i, m in enumerate(x["messages"]) if m["role"] == "assistant"]
        assert sum(1 for k in steps if k[0] == rid) == len(assistant)
        for k, i in enumerate(assistant, start=1):
            assert labels[(rid, k)] == x["step_labels"][str(i)]
            content = x["messages"][i]["content"]
            assert content in steps[(rid, k)]
    for _, g in r.group_by("group_id"):
        mixed += g["outcome"].n_unique() > 1
    assert mixed == 26
