"""tau2-bench telecom: the user simulator calls tools of its own (issue 31). Those calls and
their results are observations, never agent steps, and no token of them is the agent's."""

from __future__ import annotations

import json

import polars as pl
import pytest

from draco_cli.ingest import ingest
from tests.tau2_telecom import results


@pytest.fixture
def telecom(tmp_path):
    path = tmp_path / "telecom.json"
    path.write_text(json.dumps(results()))
    return path


def _read(out):
    return pl.read_parquet(out / "rollouts.parquet"), pl.read_parquet(out / "steps.parquet")


def test_user_tool_calls_ingest_as_observations(telecom, tmp_path):
    ingest("tau2-bench", [telecom], tmp_path / "o")
    rollouts, steps = _read(tmp_path / "o")
    assert rollouts.height == 4
    raw = results()["simulations"]
    # one step per generated assistant message (the greeting is the harness's)
    for sim in raw:
        mine = steps.filter(pl.col("rollout_id") == sim["id"])
        n_agent = sum(m["role"] == "assistant" and m["usage"] is not None
                      for m in sim["messages"])
        assert mine.height == n_agent
        assert not mine["action"].str.contains("check_status_bar|toggle_airplane").any()
    first = steps.filter(pl.col("rollout_id") == "sim-0-0").sort("step")
    obs = first["observation"][1]
    assert "[user calls tool] check_status_bar({})" in obs
    assert "[tool check_status_bar, to the user] Status Bar: Airplane Mode" in obs
    assert "[user] It shows airplane mode is on." in obs
    # the last agent message's observation holds the user's toggle and its result
    assert "toggle_airplane_mode" in first["observation"][2]


def test_tool_call_unit_keeps_only_agent_calls(telecom, tmp_path):
    ingest("tau2-bench", [telecom], tmp_path / "o", step_unit="tool-call", tokenizer="approx")
    _, steps = _read(tmp_path / "o")
    names = steps["action"].str.extract(r"^(\w+)\(").to_list()
    assert set(names) == {"get_customer_by_phone", "transfer_to_human_agents"}


def test_user_side_tokens_are_not_in_the_agent_sequence(telecom, tmp_path):
    # Without usage a tokenizer counts the blocks: the user's own tool traffic is not counted.
    data = results()
    for sim in data["simulations"]:
        for m in sim["messages"]:
            m.pop("usage", None)
    data["simulations"][0]["messages"][0]["usage"] = None
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    ingest("tau2-bench", [bare], tmp_path / "a", tokenizer="approx")
    # the same log without the user's tool traffic lays the agent's tokens out identically
    for sim in data["simulations"]:
        user_ids = {c["id"] for m in sim["messages"] if m["role"] == "user"
                    for c in m.get("tool_calls") or []}
        sim["messages"] = [m for m in sim["messages"]
                           if not (m["role"] == "user" and m.get("tool_calls"))
                           and not (m["role"] == "tool" and m["id"] in user_ids)]
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(data))
    ingest("tau2-bench", [plain], tmp_path / "b", tokenizer="approx")
    (ra, sa), (rb, sb) = _read(tmp_path / "a"), _read(tmp_path / "b")
    cols = ["rollout_id", "response_len", "policy_spans"]
    assert ra.select(cols).sort("rollout_id").equals(rb.select(cols).sort("rollout_id"))
    keys = ["rollout_id", "step", "n_tokens", "token_start"]
    assert sa.select(keys).sort(keys[:2]).equals(sb.select(keys).sort(keys[:2]))


def test_logged_prompt_growth_gives_the_blocks(telecom, tmp_path):
    ingest("tau2-bench", [telecom], tmp_path / "o")
    rollouts, steps = _read(tmp_path / "o")
    first = steps.filter(pl.col("rollout_id") == "sim-0-0").sort("step")
    # usage: (2400, 24), (2450, 30), (2500, 18): blocks 2450-2400-24 and 2500-2450-30
    assert first["n_tokens"].to_list() == [24, 30, 18]
    assert first["token_start"].to_list() == [0, 24 + 26, 24 + 26 + 30 + 20]
