"""Step units, token splitting and layout on hand-made episodes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from draco_cli.ingest.codeblocks import CodeRule
from draco_cli.ingest.episode import BuildOptions, Episode, Message, ToolCall, build
from draco_cli.ingest.tokens import ApproxCounter, apportion


def ep(messages, **kw):
    return Episode(rollout_id="r", task_id="t", instruction="i", messages=messages, where="e", **kw)


CODE_MSG = "Let me look.\n```python\nprint(1)\n```\nand then\n```python\nx = 2\n```"


def test_code_block_unit_makes_blocks_steps_and_text_gap():
    e = ep([Message("user", "go"), Message("assistant", CODE_MSG), Message("user", "Output: 1")])
    every_python_block = CodeRule(frozenset({"python"}), "all")
    b = build(e, BuildOptions("code-block", ApproxCounter(), "s", every_python_block))
    assert [s["action"] for s in b.steps] == ["```python\nprint(1)\n```", "```python\nx = 2\n```"]
    c = ApproxCounter().count
    gap1 = c("Let me look.\n")
    assert b.steps[0]["token_start"] == gap1
    assert b.steps[0]["n_tokens"] == c("```python\nprint(1)\n```")
    # the observation goes to the last block the message ran
    assert b.steps[0]["observation"] == "" and b.steps[1]["observation"] == "[user] Output: 1"
    total = sum(c(p) for p in ["Let me look.\n", "```python\nprint(1)\n```", "\nand then\n",
                               "```python\nx = 2\n```"])
    assert b.rollout["policy_spans"] == [[0, total]]
    assert b.rollout["response_len"] == total + c("[user] Output: 1".removeprefix("[user] "))


def test_message_without_block_is_no_action_in_code_block_unit():
    e = ep([Message("user", "go"), Message("assistant", "I refuse.", n_tokens=5)],
           termination="submitted")
    b = build(e, BuildOptions("code-block", None, "s"))
    assert b.steps == [] and b.rollout["termination"] == "no_action"
    assert b.rollout["policy_spans"] == [[0, 5]] and b.rollout["response_len"] == 5


def test_no_assistant_at_all_is_valid_no_action():
    b = build(ep([Message("user", "go")]), BuildOptions("message", None, "s"))
    assert b.steps == [] and b.rollout["termination"] == "no_action"
    assert b.rollout["response_len"] == 0 and b.rollout["n_turns"] == 0


def test_tool_call_unit_logged_total_is_apportioned():
    calls = [ToolCall("a", "f", {"q": "x" * 40}), ToolCall("b", "g", {})]
    msgs = [Message("user", "go"), Message("assistant", "thinking " * 10, calls=calls, n_tokens=50),
            Message("tool", "ra", call_id="a", n_tokens=3), Message("tool", "rb", call_id="b", n_tokens=4),
            Message("user", "thanks", n_tokens=2), Message("assistant", "bye", n_tokens=1)]
    b = build(ep(msgs), BuildOptions("tool-call", ApproxCounter(), "s"))
    assert [s["action"].split("(")[0] for s in b.steps] == ["f", "g"]
    gap = 50 - b.steps[0]["n_tokens"] - b.steps[1]["n_tokens"]
    assert gap > 0 and b.steps[0]["token_start"] == gap
    assert b.steps[1]["token_start"] == gap + b.steps[0]["n_tokens"]
    assert b.steps[0]["observation"] == "[tool f] ra"
    assert b.steps[1]["observation"] == "[tool g] rb\n[user] thanks"
    # 50 policy tokens, 9 observation tokens, 1 more policy token
    assert b.rollout["policy_spans"] == [[0, 50], [59, 60]] and b.rollout["response_len"] == 60
    assert b.token_source == "log+tokenizer"


def test_unknown_observation_tokens_leave_positions_unknown():
    msgs = [Message("user", "go"), Message("assistant", "a", n_tokens=3), Message("user", "b"),
            Message("assistant", "c", n_tokens=2)]
    b = build(ep(msgs), BuildOptions("message", None, "s"))
    assert [s["n_tokens"] for s in b.steps] == [3, 2]
    assert all(s["token_start"] is None for s in b.steps)
    assert b.rollout["response_len"] is None and b.rollout["policy_spans"] is None
    assert not b.layout_known


@given(st.integers(0, 10_000), st.lists(st.tuples(st.integers(0, 500), st.booleans()),
                                        min_size=1, max_size=12))
def test_apportion_conserves_and_respects_minimums(total, parts):
    weights = [w for w, _ in parts]
    minimum = [1 if s else 0 for _, s in parts]
    if total < sum(minimum):
        return
    out = apportion(total, weights, minimum)
    assert sum(out) == total
    assert all(o >= m for o, m in zip(out, minimum))
