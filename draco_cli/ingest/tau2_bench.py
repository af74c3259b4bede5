"""``tau2-bench``: one JSON object {timestamp, info, tasks[], simulations[]} (sierra-research/
tau2-bench results); fields and token counts: see docs/ingest.md, "tau2-bench". Tool-call
arguments are objects; an assistant may call several tools at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TextIO

from draco_cli.errors import InputError
from draco_cli.ingest.chat import EntryContext, Item, as_object, parse_messages
from draco_cli.ingest.episode import Episode
from draco_cli.ingest.jsonstream import iter_object_with_array


TERMINATION = {
    "user_stop": "submitted",
    "agent_stop": "submitted",
    "transfer": "submitted",
    "max_steps": "max_turns",
    "too_many_errors": "env_error",
    "agent_error": "env_error",
    "user_error": "env_error",
}


def _label(i: int) -> str:
    return f"simulations[{i}]"


def iter_episodes(fp: TextIO, source: str) -> Iterator[Item]:
    tasks: dict[str, dict[str, Any]] | None = None
    # The agent's policy, once per file (tau2 writes ``info`` before the simulations).
    policy: str | None = None
    pending: list[tuple[int, Any]] = []  # simulations seen before the task list (unusual)
    seen_simulations = False
    try:
        for key, value in iter_object_with_array(fp, source, "simulations", _label):
            if key == "info":
                policy = policy_of(value)
            elif key == "tasks":
                tasks = _task_index(value)
                for index, raw in pending:
                    yield _convert(index, raw, tasks, source, policy)
                pending = []
            elif key == "simulations":
                seen_simulations = True
                index, raw = value
                if tasks is None:
                    pending.append((index, raw))
                else:
                    yield _convert(index, raw, tasks, source, policy)
    except InputError as exc:
        yield exc.row if isinstance(exc.row, str) else "file", exc
        return
    for index, raw in pending:  # no task list at all: instructions come from the dialogue
        yield _convert(index, raw, {}, source, policy)
    if not seen_simulations:
        yield "file", InputError("no simulations: a tau2-bench results file holds a "
                                 "non-empty 'simulations' list", file=source,
                                 field="simulations")


def _task_index(value: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(value, list):
        return {}
    return {str(t.get("id")): t for t in value if isinstance(t, dict)}


def policy_of(info: Any) -> str | None:
    """The agent's policy: ``info.environment_info.policy``."""
    policy = as_object(as_object(info).get("environment_info")).get("policy")
    return policy if isinstance(policy, str) and policy.strip() else None


def _convert(index: int, raw: Any, tasks: dict[str, dict[str, Any]], source: str,
             policy: str | None = None) -> Item:
    where = _label(index)
    try:
        episode = to_episode(raw, EntryContext(source, where), tasks)
    except InputError as exc:
        return where, exc
    episode.task_context = policy
    return where, episode


def instruction_of(task: dict[str, Any] | None) -> str | None:
    if not task:
        return None
    scenario = task.get("user_scenario") or {}
    instr = scenario.get("instructions") if isinstance(scenario, dict) else None
    if isinstance(instr, str):
        return instr
    if not isinstance(instr, dict):
        return None
    labels = [("reason_for_call", "Reason for call"), ("known_info", "Known info"),
              ("unknown_info", "Unknown info"), ("task_instructions", "Task instructions")]
    lines = [f"{title}: {instr[k].strip()}" for k, title in labels if isinstance(instr.get(k), str)]
    return "\n".join(lines) or None


def to_episode(raw: Any, ctx: EntryContext, tasks: dict[str, dict[str, Any]]) -> Episode:
    if not isinstance(raw, dict):
        raise ctx.error("a simulation must be a JSON object")
    task_id = str(ctx.require(raw, "task_id", (str, int)))
    messages = parse_messages(raw.get("messages"), ctx)
    raw_msgs: list[Any] = raw["messages"]  # a list: parse_messages checked it
    first_user = next((i for i, m in enumerate(messages) if m.role == "user"), len(messages))
    for i, (m, r) in enumerate(zip(messages, raw_msgs)):
        if m.role != "assistant":
            continue
        usage = r.get("usage")
        if usage is None and i < first_user:
            # tau2's orchestrator opens with a fixed greeting that no model generated.
            m.policy = False
            continue
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            m.n_tokens = usage["completion_tokens"]
    # Observation blocks from the growth of the prompt between consecutive policy calls.
    block_tokens: dict[int, int] = {}
    policy = [i for i, m in enumerate(messages) if m.role == "assistant" and m.policy]
    for a, b in zip(policy, policy[1:]):
        ua, ub = as_object(raw_msgs[a].get("usage")), as_object(raw_msgs[b].get("usage"))
        pa_, pb, ca = ua.get("prompt_tokens"), ub.get("prompt_tokens"), ua.get("completion_tokens")
        if isinstance(pa_, int) and isinstance(pb, int) and isinstance(ca, int) \
                and pb - pa_ - ca >= 0:
            block_tokens[a] = pb - pa_ - ca
    reward_info = as_object(raw.get("reward_info"))
    reward = ctx.optional(reward_info, "reward", (int, float), "reward_info.")
    reason = raw.get("termination_reason")
    reason = reason if isinstance(reason, str) else None
    instruction = instruction_of(tasks.get(task_id))
    if instruction is None:
        instruction = messages[first_user].content if first_user < len(messages) else ""
    sim_id = raw.get("id")
    trial = ctx.optional(raw, "trial", int)
    return Episode(
        rollout_id=str(sim_id) if sim_id is not None else f"{task_id}-{trial or 0}",
        task_id=task_id,
        instruction=instruction,
        messages=messages,
        where=ctx.where,
        outcome=float(reward) if reward is not None else None,
        outcome_field="reward_info.reward",
        termination=TERMINATION.get(reason) if reason else None,
        termination_raw=reason,
        trial=trial,
        block_tokens=block_tokens,
    )
