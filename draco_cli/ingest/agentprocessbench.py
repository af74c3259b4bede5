"""``agentprocessbench``: AgentProcessBench trajectories with human step labels
(RUCBM/AgentProcessBench, one trajectory per line). Ids, outcome, steps and how the labels map
to steps (the build, ``draco_cli.ingest.episode``): see docs/ingest.md, "agentprocessbench".
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any, TextIO

from draco_cli.ingest.chat import EntryContext, Item, json_lines, parse_messages
from draco_cli.ingest.episode import Episode

LABELS = (-1, 0, 1)


def iter_episodes(fp: TextIO, source: str) -> Iterator[Item]:
    return json_lines(fp, source, lambda raw, ctx, _: to_episode(raw, ctx))


def label_value(value: Any) -> int | None:
    """A step label as an int in {-1, 0, 1}, or None when it is anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if value in LABELS else None


def parse_label_keys(raw: Any, ctx: EntryContext, field: str) -> dict[int, int]:
    """A {"<index>": label} object as {index: label}; a bad key or label is an error naming
    it."""
    if not isinstance(raw, dict):
        raise ctx.error("expected an object of index -> label", field)
    out: dict[int, int] = {}
    for key, value in raw.items():
        try:
            index = int(key)
        except ValueError:
            raise ctx.error(f"key {key!r} is not an integer index", f"{field}[{key!r}]") from None
        label = label_value(value)
        if label is None:
            raise ctx.error(f"label {value!r} is not one of -1, 0, 1", f"{field}[{key!r}]")
        out[index] = label
    return out


def _normalise_calls(messages: Any) -> Any:
    """Some AgentProcessBench splits store an assistant's ``tool_calls`` as a string holding a
    Python-style list: read it as the list it spells."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), str):
            text = m["tool_calls"].strip()
            try:
                calls = ast.literal_eval(text) if text else None
            except (ValueError, SyntaxError):
                calls = m["tool_calls"]  # left as is: parse_messages names the field
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def to_episode(raw: Any, ctx: EntryContext) -> Episode:
    if not isinstance(raw, dict):
        raise ctx.error("a line must hold one JSON object")
    source = ctx.require(raw, "data_source", str)
    query = ctx.require(raw, "query_index", (int, str))
    sample = ctx.require(raw, "sample_index", int)
    question = ctx.require(raw, "question", str)
    final = ctx.require(raw, "final_label", (int, float))
    if final not in (-1, 1, 0):
        raise ctx.error(f"final_label {final!r} is not one of -1, 0, 1", "final_label")
    messages = parse_messages(_normalise_calls(raw.get("messages")), ctx)
    labels = parse_label_keys(raw.get("step_labels") or {}, ctx, "step_labels")
    answer = raw.get("answer_text")
    task = f"{source}:{query}"
    return Episode(
        rollout_id=f"{task}:{sample}",
        task_id=task,
        group_id=task,
        instruction=question,
        messages=messages,
        where=ctx.where,
        outcome=1.0 if final == 1 else 0.0,
        termination="submitted" if isinstance(answer, str) and answer.strip() else None,
        termination_raw=None,
        trial=sample,
        outcome_field="final_label",
        message_labels=labels,
    )
