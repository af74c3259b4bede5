"""Golden tests on the real tau-bench and tau2-bench logs in ../shared/data."""

from __future__ import annotations

import json
import math
from collections import Counter

import polars as pl
import pytest

from draco_cli.ingest import ingest
from tests.conftest import TAU, TAU2, TAU2_FT


@pytest.fixture(scope="module")
def tau_raw():
    return json.loads(TAU.read_text())


@pytest.fixture(scope="module")
def tau2_raw():
    return json.loads(TAU2.read_text())


@pytest.fixture(scope="module")
def tau_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("tau")
    ingest("tau-bench", [TAU], out, tokenizer="approx")
    return pl.read_parquet(out / "rollouts.parquet"), pl.read_parquet(out / "steps.parquet"), \
        json.loads((out / "manifest.json").read_text())


def test_tau_bench_groups_and_rewards(tau_out):
    rollouts, steps, manifest = tau_out
    # The data README: 15 tasks x 4 trials; 3 tasks each with 0, 1, 2, 3, 4 successes.
    assert rollouts.height == 60
    assert rollouts["group_id"].n_unique() == 15
    assert set(rollouts.group_by("group_id").len()["len"]) == {4}
    assert rollouts["outcome"].sum() == 30
    per_task = rollouts.group_by("task_id").agg(pl.col("outcome").sum())["outcome"]
    assert Counter(per_task.to_list()) == {0: 3, 1: 3, 2: 3, 3: 3, 4: 3}
    assert sorted(rollouts["trial"].unique()) == [0, 1, 2, 3]
    assert manifest["rollouts"] == 60 and manifest["groups"] == 15
    assert manifest["tokenizer_exact"] is False


def test_tau_bench_steps_match_assistant_messages(tau_out, tau_raw):
    rollouts, steps, _ = tau_out
    for entry in tau_raw[:10]:
        rid = f"{entry['task_id']}-{entry['trial']}"
        acting = [m for m in entry["traj"] if m["role"] == "assistant"
                  and (m.get("content") or m.get("tool_calls"))]
        mine = steps.filter(pl.col("rollout_id") == rid).sort("step")
        assert mine.height == len(acting)
        assert mine["step"].to_list() == list(range(1, len(acting) + 1))
        row = rollouts.filter(pl.col("rollout_id") == rid).row(0, named=True)
        assert row["n_turns"] == sum(m["role"] == "assistant" for m in entry["traj"])
        assert row["instruction"] == entry["info"]["task"]["instruction"]
        # approx counts: ceil(chars/4) of the step's text, which starts with the message text
        first = acting[0]
        if first.get("content") and not first.get("tool_calls"):
            assert mine["n_tokens"][0] == math.ceil(len(first["content"]) / 4)
    assert steps.height == sum(
        1 for e in tau_raw for m in e["traj"]
        if m["role"] == "assistant" and (m.get("content") or m.get("tool_calls"))
    )


def test_tau_bench_termination(tau_out, tau_raw):
    rollouts, _, _ = tau_out
    capped = {f"{e['task_id']}-{e['trial']}" for e in tau_raw if e["info"]["reward_info"] is None}
    assert len(capped) == 1
    got = dict(zip(rollouts["rollout_id"], rollouts["termination"]))
    assert {r for r, t in got.items() if t == "max_turns"} == capped
    assert Counter(got.values()) == {"submitted": 59, "max_turns": 1}


def test_tau_bench_layout_is_consistent(tau_out):
    rollouts, steps, _ = tau_out
    j = steps.join(rollouts.select("rollout_id", "response_len"), on="rollout_id")
    assert (j["token_start"] + j["n_tokens"] <= j["response_len"]).all()
    # steps in order and not overlapping
    j = j.sort("rollout_id", "step").with_columns(
        (pl.col("token_start") + pl.col("n_tokens")).shift(1).over("rollout_id").alias("prev"))
    assert (j.filter(pl.col("prev").is_not_null())
            .select((pl.col("token_start") >= pl.col("prev")).all()).item())


def test_tau2_token_counts_from_usage(tmp_path, tau2_raw):
    ingest("tau2-bench", [TAU2], tmp_path)
    steps = pl.read_parquet(tmp_path / "steps.parquet")
    rollouts = pl.read_parquet(tmp_path / "rollouts.parquet")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["token_counts"] == ["log"] and manifest["tokenizer"] is None
    assert rollouts.height == 20 and rollouts["group_id"].n_unique() == 20
    assert rollouts["outcome"].sum() == sum(s["reward_info"]["reward"] for s in tau2_raw["simulations"])
    for sim in tau2_raw["simulations"]:
        policy = [m for m in sim["messages"] if m["role"] == "assistant" and m["usage"]]
        mine = steps.filter(pl.col("rollout_id") == sim["id"]).sort("step")
        assert mine["n_tokens"].to_list() == [m["usage"]["completion_tokens"] for m in policy]
        # Positions: each step starts where the previous one's prompt grew to.
        base = policy[0]["usage"]["prompt_tokens"]
        expect = [m["usage"]["prompt_tokens"] - base for m in policy]
        assert mine["token_start"].to_list() == expect
        row = rollouts.filter(pl.col("rollout_id") == sim["id"]).row(0, named=True)
        assert row["response_len"] == expect[-1] + policy[-1]["usage"]["completion_tokens"]
        assert row["termination"] == "submitted" and row["termination_raw"] == "user_stop"
        # the fixed greeting is prompt, not a policy turn
        assert row["n_turns"] == len(policy)


def test_tau2_tool_call_unit_splits_parallel_calls(tmp_path, tau2_raw):
    ingest("tau2-bench", [TAU2, TAU2_FT], tmp_path, step_unit="tool-call", tokenizer="approx")
    steps = pl.read_parquet(tmp_path / "steps.parquet")
    rollouts = pl.read_parquet(tmp_path / "rollouts.parquet")
    assert rollouts.height == 40
    n_calls = sum(len(m["tool_calls"] or []) for s in tau2_raw["simulations"]
                  for m in s["messages"] if m["role"] == "assistant")
    ids = [s["id"] for s in tau2_raw["simulations"]]
    assert steps.filter(pl.col("rollout_id").is_in(ids)).height == n_calls
    # The message with 12 parallel calls becomes 12 steps whose tokens fit its usage.
    sim, msg = next((s, m) for s in tau2_raw["simulations"] for m in s["messages"]
                    if m["role"] == "assistant" and len(m["tool_calls"] or []) == 12)
    mine = steps.filter(pl.col("rollout_id") == sim["id"])
    names = [c["name"] for c in msg["tool_calls"]]
    block = mine.filter(pl.col("action").str.starts_with(names[0]))
    assert block.height >= 1
    start = mine.filter(pl.col("token_start") >= block["token_start"].min()).sort("step").head(12)
    assert start["n_tokens"].sum() <= msg["usage"]["completion_tokens"]
    assert [a.split("(")[0] for a in start["action"]] == names
    # each call's observation is its own tool result
    first_result = next(m for m in sim["messages"] if m["role"] == "tool"
                        and m["id"] == msg["tool_calls"][0]["id"])
    assert first_result["content"][:40] in start["observation"][0]


def test_tau2_tool_call_unit_needs_a_tokenizer_to_split(tmp_path):
    from draco_cli.errors import InputError

    with pytest.raises(InputError, match=r"splits it into \d+ parts; pass --tokenizer"):
        ingest("tau2-bench", [TAU2], tmp_path, step_unit="tool-call")
    assert not (tmp_path / "rollouts.parquet").exists()


def test_hf_tokenizer_counts(tmp_path, tau_raw):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [m.get("content") or "" for e in tau_raw[:5] for m in e["traj"]],
        trainers.WordLevelTrainer(special_tokens=["[UNK]"]),
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    ingest("tau-bench", [TAU], tmp_path / "out", tokenizer=str(path))
    steps = pl.read_parquet(tmp_path / "out" / "steps.parquet")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tokenizer"] == str(path) and manifest["tokenizer_exact"] is True
    entry = tau_raw[0]
    first = next(m for m in entry["traj"] if m["role"] == "assistant")
    expect = len(tok.encode(first["content"], add_special_tokens=False).ids)
    got = steps.filter((pl.col("rollout_id") == "0-0") & (pl.col("step") == 1))["n_tokens"][0]
    assert got == expect


def test_train_step_and_group_by(tmp_path):
    ingest("tau-bench", [TAU], tmp_path / "a", tokenizer="approx", train_step=7)
    r = pl.read_parquet(tmp_path / "a" / "rollouts.parquet")
    assert (r["train_step"] == 7).all()
    assert r["group_id"][0] == f"{r['task_id'][0]}/7"
    ingest("tau-bench", [TAU], tmp_path / "b", tokenizer="approx", group_by=("task_id", "trial"))
    r = pl.read_parquet(tmp_path / "b" / "rollouts.parquet")
    assert r["group_id"].n_unique() == 60
