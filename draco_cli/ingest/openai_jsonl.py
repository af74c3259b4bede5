"""``openai-jsonl``: the generic format, one rollout per line; fields, ``n_tokens`` and
``response_mask`` / ``response_ids``: see docs/ingest.md, "openai-jsonl".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from draco_cli.ingest.chat import (EntryContext, Item, first_user_text, json_lines,
                                   parse_messages, trainer_tokens)
from draco_cli.ingest.episode import Episode
from draco_cli.schemas import Termination

TERMINATIONS = Termination.__args__  # type: ignore[attr-defined]


def iter_episodes(fp: TextIO, source: str) -> Iterator[Item]:
    stem = Path(source).stem
    return json_lines(fp, source, lambda raw, ctx, n: to_episode(raw, ctx, f"{stem}:{n}"))


def to_episode(raw: Any, ctx: EntryContext, default_id: str) -> Episode:
    if not isinstance(raw, dict):
        raise ctx.error("a line must hold one JSON object")
    task_id = ctx.require(raw, "task_id", (str, int))
    messages = parse_messages(raw.get("messages"), ctx)
    termination = ctx.optional(raw, "termination", str)
    if termination is not None and termination not in TERMINATIONS:
        raise ctx.error(f"{termination!r} is not one of {', '.join(TERMINATIONS)}", "termination")
    instruction = ctx.optional(raw, "instruction", str)
    if instruction is None:
        instruction = first_user_text(messages)
    outcome = ctx.optional(raw, "outcome", (int, float))
    rid = ctx.optional(raw, "rollout_id", (str, int))
    gid = ctx.optional(raw, "group_id", (str, int))
    scen = ctx.optional(raw, "scenario_id", (str, int))
    diff = ctx.optional(raw, "difficulty", (str, int))
    mask, ids = trainer_tokens(raw, ctx)
    return Episode(
        rollout_id=str(rid) if rid is not None else default_id,
        task_id=str(task_id),
        instruction=instruction,
        messages=messages,
        where=ctx.where,
        outcome=float(outcome) if outcome is not None else None,
        termination=termination,
        termination_raw=termination,
        trial=ctx.optional(raw, "trial", int),
        train_step=ctx.optional(raw, "train_step", int),
        scenario_id=str(scen) if scen is not None else None,
        difficulty=str(diff) if diff is not None else None,
        group_id=str(gid) if gid is not None else None,
        response_mask=mask,
        response_ids=ids,
        task_context=ctx.optional(raw, "task_context", str),
    )
