"""A corpus of malformed inputs, each with the message a user must see."""

from __future__ import annotations

import json

import pytest

from draco_cli.errors import InputError
from draco_cli.ingest import ingest
from tests.conftest import TAU, run_draco, write_jsonl


def _tool_orphan(row):
    row["messages"][3]["tool_call_id"] = "nope"
    return row


def _unknown_role(row):
    row["messages"][1]["role"] = "narrator"
    return row


def _bad_tokens(row):
    row["messages"][2]["n_tokens"] = -3
    return row


JSONL_CASES = [
    ("truncated", lambda r: json.dumps(r)[:-7],
     r"x\.jsonl: line 1: truncated JSON"),
    ("not json", lambda r: "{task_id: 1}", r"x\.jsonl: line 1: invalid JSON"),
    ("not an object", lambda r: "[1, 2]", r"line 1: a line must hold one JSON object"),
    ("unknown role", _unknown_role,
     r"line 1: field 'messages\[1\]\.role': unknown role 'narrator'"),
    ("orphan tool result", _tool_orphan,
     r"line 1: field 'messages\[3\]\.tool_call_id': tool result answers no earlier tool call"),
    ("no messages", lambda r: {**r, "messages": []}, r"line 1: field 'messages': no messages"),
    ("messages missing", lambda r: {k: v for k, v in r.items() if k != "messages"},
     r"line 1: field 'messages': missing"),
    ("task_id missing", lambda r: {k: v for k, v in r.items() if k != "task_id"},
     r"line 1: field 'task_id': missing"),
    ("bad outcome", lambda r: {**r, "outcome": "yes"},
     r"field 'outcome': expected an integer or a number, got str"),
    ("bad termination", lambda r: {**r, "termination": "crashed"},
     r"field 'termination': 'crashed' is not one of submitted"),
    ("negative tokens", _bad_tokens,
     r"field 'messages\[2\]\.n_tokens': n_tokens must be a non-negative integer"),
    ("bad tool_calls", lambda r: {**r, "messages": r["messages"][:2] + [
        {"role": "assistant", "tool_calls": {"id": "x"}}]},
     r"field 'messages\[2\]\.tool_calls': tool_calls must be a list"),
]


@pytest.mark.parametrize("name,mutate,message", JSONL_CASES, ids=[c[0] for c in JSONL_CASES])
def test_jsonl_errors_name_file_line_and_field(tmp_path, chat_row, name, mutate, message):
    src = write_jsonl(tmp_path / "x.jsonl", [mutate(chat_row())])
    with pytest.raises(InputError, match=message):
        ingest("openai-jsonl", [src], tmp_path / "out")
    assert not (tmp_path / "out" / "rollouts.parquet").exists()


def test_duplicate_rollout_id(tmp_path, chat_row):
    src = write_jsonl(tmp_path / "x.jsonl", [chat_row(), chat_row()])
    with pytest.raises(InputError, match=r"line 2: field 'rollout_id': duplicate rollout_id 'r1' "
                                         r"\(first at .*x\.jsonl line 1\)"):
        ingest("openai-jsonl", [src], tmp_path / "out")


def test_skip_invalid_writes_rejects_and_goes_on(tmp_path, chat_row):
    rows = [chat_row(rollout_id="a"), json.dumps(chat_row())[:30],
            _unknown_role(chat_row(rollout_id="b")), chat_row(rollout_id="c")]
    src = write_jsonl(tmp_path / "x.jsonl", rows)
    res = ingest("openai-jsonl", [src], tmp_path / "out", skip_invalid=True)
    assert res.rollouts == 2 and res.rejected == 2
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["entry"] for r in rejects] == ["line 2", "line 3"]
    assert "truncated JSON" in rejects[0]["reason"] and "unknown role" in rejects[1]["reason"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["rejected"] == 2


def test_tau_bench_truncated_file(tmp_path):
    data = TAU.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cut\.json: entry \d+: truncated JSON at character"):
        ingest("tau-bench", [cut], tmp_path / "out", tokenizer="approx")
    # with --skip-invalid, the entries before the cut are kept and the cut is reported
    res = ingest("tau-bench", [cut], tmp_path / "out", tokenizer="approx", skip_invalid=True)
    assert 20 < res.rollouts < 40 and res.rejected == 1


def test_tau_bench_bad_entry(tmp_path):
    entries = json.loads(TAU.read_text())[:3]
    entries[1]["traj"][2]["role"] = "robot"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(entries))
    with pytest.raises(InputError, match=r"bad\.json: entry 1: field 'traj\[2\]\.role': unknown role"):
        ingest("tau-bench", [bad], tmp_path / "out", tokenizer="approx")


def test_tau_bench_not_a_list(tmp_path):
    bad = tmp_path / "obj.json"
    bad.write_text('{"task_id": 1}')
    with pytest.raises(InputError, match=r"obj\.json: entry 0: invalid JSON: expected '\['"):
        ingest("tau-bench", [bad], tmp_path / "out", tokenizer="approx")


def test_tau2_bad_simulation(tmp_path):
    from tests.conftest import TAU2

    doc = json.loads(TAU2.read_text())
    doc["simulations"] = doc["simulations"][:2]
    del doc["simulations"][1]["task_id"]
    bad = tmp_path / "t2.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"t2\.json: simulations\[1\]: field 'task_id': missing"):
        ingest("tau2-bench", [bad], tmp_path / "out")


def test_not_utf8(tmp_path):
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b'{"task_id": "\xff\xfe"}\n')
    with pytest.raises(InputError, match=r"bin\.jsonl: not UTF-8 text"):
        ingest("openai-jsonl", [bad], tmp_path / "out")


def test_missing_input_file_cli(tmp_path):
    res = run_draco("ingest", "openai-jsonl", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o"))
    assert res.returncode == 1
    assert "nope.jsonl: no such file" in res.stderr.decode()


def test_no_token_counts_is_an_error_not_a_guess(tmp_path):
    with pytest.raises(InputError, match=r"entry 0: field 'traj': the log has no token counts"):
        ingest("tau-bench", [TAU], tmp_path / "out")
