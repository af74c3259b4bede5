"""Rendering rollouts into prompt text: numbered steps, long observations shortened in the
middle, untrusted text fenced so it cannot close its fence or pose as instructions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import polars as pl

from draco_cli.redact import Redactor

CHARS_PER_TOKEN = 4  # prompt budgets are estimates; the provider's count is what is billed
# What a prompt holds besides the task context, the task and the steps: the rules, the stage's
# instructions, the criteria or candidates, the answer schema in the prompt form. One allowance
# for every stage, so that a rollout's steps render to the same bytes in each (one cached head).
PROMPT_RESERVE_TOKENS = 1200


def fence_token(text: str) -> str:
    """A marker derived from the text itself: the text cannot contain its own hash, so it
    cannot close the fence early (and the prompt stays deterministic, for the cache)."""
    return "DATA-" + hashlib.sha256(text.encode()).hexdigest()[:16].upper()


def fenced(label: str, body: str) -> str:
    tag = fence_token(body)
    return (f"<<<{tag} {label}: untrusted data begins>>>\n{body}\n"
            f"<<<{tag} {label}: untrusted data ends>>>")


def shorten(text: str, limit: int) -> str:
    """Keep the head and tail of a long text, with a visible marker in the middle."""
    if len(text) <= limit:
        return text
    keep = max(limit - 60, 20)
    head, tail = keep * 2 // 3, keep // 3
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters omitted ...]\n{text[-tail:]}"


@dataclass
class RenderOptions:
    max_prompt_tokens: int = 24000
    observation_chars: int = 2000  # before budget-driven shortening
    redactor: Redactor | None = None


def rollout_budget(opts: RenderOptions, context: str, instruction: str) -> int:
    """Tokens left for a rollout's steps under ``max_prompt_tokens`` (the whole prompt's
    budget) once its task context block, its task and the stages' allowance are counted; at
    least 250 (a window too small for the task context is the server's to refuse, with its
    reason)."""
    used = (len(context) + len(instruction)) // CHARS_PER_TOKEN + PROMPT_RESERVE_TOKENS
    return max(opts.max_prompt_tokens - used, 250)


def render_rollout(instruction: str, steps: pl.DataFrame, opts: RenderOptions,
                   budget_tokens: int | None = None) -> tuple[str, str]:
    """(task text, trajectory text) of one rollout. Actions are shown in full; observations are
    shortened in the middle, more and more, until the whole fits the budget."""
    return render_steps(instruction, steps["step"].to_list(), steps["action"].to_list(),
                        steps["observation"].to_list(), opts, budget_tokens)


def render_steps(instruction: str, numbers: list[int], actions: list[str], observations: list[str],
                 opts: RenderOptions, budget_tokens: int | None = None) -> tuple[str, str]:
    """``render_rollout`` over the step columns as lists (the judge stage slices them from one
    sorted table instead of building a frame per rollout)."""
    budget = (budget_tokens or opts.max_prompt_tokens) * CHARS_PER_TOKEN
    red = opts.redactor
    if red is not None:
        instruction = red(instruction)
        actions = [red(a) for a in actions]
        observations = [red(o) for o in observations]
    limit = opts.observation_chars
    while True:
        parts = []
        for n, a, o in zip(numbers, actions, observations):
            block = f"### Step {n}\nAction:\n{a}"
            if o:
                block += f"\nObservation:\n{shorten(o, limit)}"
            parts.append(block)
        body = "\n\n".join(parts) if parts else "(the agent took no step)"
        if len(body) <= budget or limit <= 80:
            break
        limit //= 2
    if len(body) > budget:  # actions alone exceed the budget: keep head and tail of the whole
        body = shorten(body, budget)
    return instruction, body


def task_block(instruction: str) -> str:
    return fenced("task", instruction)


CONTEXT_LABEL = ("The agent's own instructions (the policy or system prompt it was given, part of "
                 "the task: the attempt is to follow them):")


class ContextBlocks:
    """The fenced block of a rollout's task context (the agent's policy), redacted and made
    once per distinct text. It opens the user message of every request that has one: the same
    bytes right after the fixed instructions, so a provider's prompt cache holds it for every
    group of the run, paid once. An empty context adds nothing (the prompt is as without)."""

    def __init__(self, redactor: Redactor | None) -> None:
        self.redactor = redactor
        self._made: dict[str, str] = {}

    def __call__(self, context: str | None) -> str:
        if not context:
            return ""
        block = self._made.get(context)
        if block is None:
            text = self.redactor(context) if self.redactor is not None else context
            fence = fenced("agent instructions", text)
            block = self._made[context] = f"{CONTEXT_LABEL}\n{fence}\n\n"
        return block


def task_contexts(rollouts: pl.DataFrame, groups: list[str]) -> dict[str, str | None]:
    """Each group's task context (its first rollout's), {} where the frame has no such column."""
    if "task_context" not in rollouts.columns or not groups:
        return {}
    g = rollouts.select("group_id", "task_context").group_by("group_id").agg(
        pl.col("task_context").first())
    return dict(zip(g["group_id"].to_list(), g["task_context"].to_list()))


def rollout_block(trajectory: str, n_steps: int) -> str:
    """One fenced rollout, as every call that shows it writes it (the union call shows the
    group's first rollout in the same bytes as that rollout's own calls)."""
    return f"Rollout ({n_steps} steps):\n{fenced('rollout', trajectory)}\n\n"


def rollout_prefix(context: str, task: str, trajectory: str, n_steps: int) -> list[str]:
    """The heads of the user message of every call about one rollout (its rubric call, its
    judge samples, their re-asks): the task context (every group that shares it), the fenced
    task (the group), then the fenced rollout — the same bytes for each, before any stage's
    instructions."""
    return [*group_prefix(context, task), rollout_block(trajectory, n_steps)]


def group_prefix(context: str, task: str) -> list[str]:
    """The heads of the user message of a group's calls (union, merge): its task context block
    (empty without one), then its fenced task."""
    return [context, f"Task:\n{task_block(task)}\n\n"]


def stage_messages(heads: str | list[str], stage_text: str
                   ) -> tuple[list[dict[str, str]], tuple[int, ...]]:
    """(messages, cache marks): the shared system rules, then one user message of the shared
    ``heads`` followed by the stage's own text; a mark where each head ends."""
    from draco_cli.prompts import system_rules

    parts = [heads] if isinstance(heads, str) else heads
    marks, at = [], 0
    for part in parts:
        if part:
            at += len(part)
            marks.append(at)
    return ([{"role": "system", "content": system_rules()},
             {"role": "user", "content": "".join(parts) + stage_text}], tuple(marks))
