"""Ingest with positions taken straight from the trainer's response mask and token ids."""

from __future__ import annotations

import json

import polars as pl
import pytest

from draco_cli.errors import InputError
from draco_cli.ingest import ingest
from draco_cli.trainers.loader import fingerprint


def _write(path, entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def _entry(**kw):
    e = {"rollout_id": "r1", "task_id": "t", "train_step": 4, "messages": [
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": "search()"},
        {"role": "user", "content": "3 results"},
        {"role": "assistant", "content": "done"}]}
    e.update(kw)
    return e


def test_steps_are_the_runs_of_the_mask(tmp_path):
    mask = [1, 1, 1, 0, 0, 0, 0, 1, 1]
    ids = [5, 6, 7, 1, 2, 3, 4, 8, 9]
    log = _write(tmp_path / "log.jsonl", [_entry(response_mask=mask, response_ids=ids)])
    res = ingest("openai-jsonl", [log], tmp_path / "out")
    steps = pl.read_parquet(tmp_path / "out" / "steps.parquet")
    assert steps["token_start"].to_list() == [0, 7]
    assert steps["n_tokens"].to_list() == [3, 2]
    r = pl.read_parquet(tmp_path / "out" / "rollouts.parquet").row(0, named=True)
    assert r["response_len"] == 9
    assert r["policy_spans"] == [[0, 3], [7, 9]]
    assert r["response_fingerprint"] == fingerprint(ids)
    assert res.token_sources == {"trainer": 1}


def test_mask_runs_must_match_the_policy_messages(tmp_path):
    log = _write(tmp_path / "log.jsonl", [_entry(response_mask=[1, 1, 0, 1, 0, 1])])
    with pytest.raises(InputError, match="3 runs of policy tokens but the episode has 2 policy "
                                         "messages") as e:
        ingest("openai-jsonl", [log], tmp_path / "out")
    assert "line 1" in str(e.value) and "response_mask" in str(e.value)


@pytest.mark.parametrize("bad, field", [
    ({"response_mask": [1, 2]}, "response_mask"),
    ({"response_mask": [1, 0, 1], "response_ids": [1, 2]}, "response_ids"),
    ({"response_ids": [1, 2]}, "response_ids"),
])
def test_bad_trainer_tokens_are_named(tmp_path, bad, field):
    log = _write(tmp_path / "log.jsonl", [_entry(**bad)])
    with pytest.raises(InputError, match=field):
        ingest("openai-jsonl", [log], tmp_path / "out")
