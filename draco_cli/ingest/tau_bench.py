"""``tau-bench``: a JSON list of {task_id, trial, reward, info, traj} (sierra-research/tau-bench
results files). ``traj`` holds OpenAI chat messages; there are no token counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TextIO

from draco_cli.errors import InputError
from draco_cli.ingest.chat import EntryContext, Item, as_object, first_user_text, parse_messages
from draco_cli.ingest.episode import Episode
from draco_cli.ingest.jsonstream import iter_array



def _label(i: int) -> str:
    return f"entry {i}"


def iter_episodes(fp: TextIO, source: str) -> Iterator[Item]:
    try:
        for index, raw in iter_array(fp, source, _label):
            where = _label(index)
            try:
                yield where, to_episode(raw, EntryContext(source, where))
            except InputError as exc:
                yield where, exc
    except InputError as exc:
        # The rest of the file cannot be read past broken JSON: report it and stop.
        yield exc.row if isinstance(exc.row, str) else "file", exc


def termination_of(info: dict[str, Any]) -> tuple[str | None, str | None]:
    """tau-bench ends an episode when the user stops (source 'user'), on a terminal tool such
    as transfer_to_human_agents, or at its step cap; only the cap leaves reward_info null (and
    source is then the name of the last action)."""
    source = info.get("source")
    raw = source if isinstance(source, str) else None
    if info.get("reward_info") is None:
        return "max_turns", raw
    return "submitted", raw


def to_episode(raw: Any, ctx: EntryContext) -> Episode:
    if not isinstance(raw, dict):
        raise ctx.error("an entry must be a JSON object")
    task_id = ctx.require(raw, "task_id", (int, str))
    trial = ctx.optional(raw, "trial", int)
    reward = ctx.optional(raw, "reward", (int, float))
    info = ctx.optional(raw, "info", dict) or {}
    task = as_object(info.get("task"))
    instruction = task.get("instruction") if isinstance(task.get("instruction"), str) else None
    messages = parse_messages(raw.get("traj"), ctx, "traj")
    if instruction is None:
        instruction = first_user_text(messages)
    termination, term_raw = termination_of(info)
    # tau-bench's agent is prompted with the domain wiki (its policy) as the system message.
    system = next((m.content for m in messages if m.role == "system" and m.content), None)
    return Episode(
        rollout_id=f"{task_id}-{trial if trial is not None else 0}",
        task_id=str(task_id),
        instruction=instruction,
        messages=messages,
        where=ctx.where,
        outcome=float(reward) if reward is not None else None,
        termination=termination,
        termination_raw=term_raw,
        trial=trial,
        messages_field="traj",
        outcome_field="reward",
        task_context=system,
    )
