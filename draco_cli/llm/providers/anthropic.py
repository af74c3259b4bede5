"""``anthropic/``: Anthropic's Messages API (and Message Batches) through the anthropic SDK's
low-level client."""

from __future__ import annotations

import json
import os
from typing import Any

import anthropic

from draco_cli.llm.errors import LLMError, ReplyRefused
from draco_cli.llm.providers.base import (ANTHROPIC_FORMS, DEFAULT_MAX_REPLY_BYTES, BatchState,
                                          Provider, fold_system, schema_instruction,
                                          split_system, with_instruction)
from draco_cli.llm.providers.sdk import get_json, get_text, http_client, jsonl, post_json
from draco_cli.llm.types import Choice, LLMRequest, Reply, Usage, counts, token_count


class AnthropicProvider(Provider):
    """Anthropic's Messages API with structured output (``output_config.format``) or a forced
    tool whose input schema is the answer schema."""

    name = "anthropic"
    supports_n = False
    forms = ANTHROPIC_FORMS
    # output_config and tools come ahead of the system text in the cache order: the prompt
    # form is the one in which a rollout's calls share a cached head (docs/decisions.md)
    default_form = "prompt"

    def __init__(self, model: str, *, base_url: str | None, concurrency: int, timeout: float,
                 structured_output: str | None = None, system_role: bool = True,
                 use_n: bool = False, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES):
        self._anthropic = anthropic
        self.model = model
        self.form = self._form(structured_output)
        self.system_role = system_role
        api_key = None
        if not (os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")):
            if base_url is None:
                raise LLMError(f"anthropic/{model}: ANTHROPIC_API_KEY is not set")
            api_key = "none"  # a local or proxy endpoint; the SDK insists on some key
        http = http_client(anthropic, concurrency, timeout, max_reply_bytes)
        self.client = anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0,
                                               timeout=timeout, http_client=http)

    def body(self, req: LLMRequest, messages: list[dict[str, str]], n: int = 1) -> dict[str, Any]:
        s = req.sampling
        if self.form == "prompt":
            messages = with_instruction(messages, schema_instruction(req.schema()))
        marks = list(req.cache_marks)
        if not self.system_role:
            folded, _ = split_system(messages)
            if folded and marks:  # the system text moved ahead of the heads
                marks = [m + len(folded) + 2 for m in marks]
            messages = fold_system(messages)
        system, chat = split_system(messages)
        body: dict[str, Any] = {"model": self.model, "max_tokens": s.max_tokens,
                                "messages": chat}
        if self.form == "output-format":
            body["output_config"] = {"format": {"type": "json_schema", "schema": req.schema()}}
        elif self.form == "tool":
            body["tools"] = [{"name": req.schema_name, "input_schema": req.schema(),
                              "description": "Record the answer."}]
            body["tool_choice"] = {"type": "tool", "name": req.schema_name}
        marked, cuts = mark_heads(chat, marks if self.form == "prompt" else [], req.samples)
        if system:
            body["system"] = [{"type": "text", "text": system}]
            if cuts < 4 - (req.samples > 1):   # the rules alone: the prefix every call shares
                body["system"][0]["cache_control"] = {"type": "ephemeral"}
        if marked != chat:
            body["messages"] = marked
        if s.thinking:
            # Thinking tokens count toward max_tokens; leave room for the answer.
            body["thinking"] = {"type": "enabled",
                                "budget_tokens": max(1024, min(s.max_tokens // 2, 16000))}
        elif s.temperature is not None:
            body["temperature"] = s.temperature  # not allowed together with thinking
        if s.top_p is not None and not s.thinking:
            body["top_p"] = s.top_p
        return body

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        if len(samples) != 1:
            raise ValueError("Anthropic answers one sample per call")
        body = self.body(req, messages)
        message, latency = await post_json(self._anthropic, self.client, "/v1/messages", body,
                                           f"anthropic/{self.model}")
        return Reply([anthropic_choice(message)], anthropic_usage(message),
                     body, message, latency)

    async def close(self) -> None:
        await self.client.close()

    # -- Anthropic Message Batches: one line per sample (no n), results as JSONL ------------

    offers_batch = True

    def batch_request(self, req: LLMRequest, samples: list[int]) -> dict[str, Any]:
        if len(samples) != 1:
            raise ValueError("Anthropic answers one sample per batch line")
        return self.body(req, req.messages)

    async def submit_batch(self, lines: dict[str, dict[str, Any]]) -> str:
        batch, _ = await post_json(
            self._anthropic, self.client, "/v1/messages/batches",
            {"requests": [{"custom_id": cid, "params": body} for cid, body in lines.items()]},
            self._label("creating the batch"))
        return str(batch["id"])

    async def poll_batch(self, batch_id: str) -> BatchState:
        b = await get_json(self._anthropic, self.client, f"/v1/messages/batches/{batch_id}",
                           self._label(f"polling batch {batch_id}"))
        status = b.get("processing_status") or "unknown"
        return BatchState(batch_id, status, status == "ended",
                          dict(b.get("request_counts") or {}))

    async def batch_results(self, batch_id: str) -> dict[str, Reply]:
        b = await get_json(self._anthropic, self.client, f"/v1/messages/batches/{batch_id}",
                           self._label(f"reading batch {batch_id}"))
        url = b.get("results_url") or f"/v1/messages/batches/{batch_id}/results"
        text = await get_text(self._anthropic, self.client, url,
                              self._label(f"reading the results of batch {batch_id}"),
                              accept="application/binary")
        out = {}
        for entry in jsonl(text):
            result = entry.get("result") or {}
            if result.get("type") == "succeeded" and entry.get("custom_id"):
                message = result["message"]
                try:
                    usage = anthropic_usage(message)
                except ReplyRefused:
                    continue   # a line with impossible counts: unanswered, asked again
                out[entry["custom_id"]] = Reply([anthropic_choice(message)], usage, {},
                                                message, 0.0, batch_id)
        return out


def mark_heads(chat: list[dict[str, Any]], marks: list[int], samples: int
               ) -> tuple[list[dict[str, Any]], int]:
    """The messages with Anthropic cache marks, and how many heads were marked. Anthropic takes
    at most 4 marks: k samples put one on the whole message; the heads ``marks`` ends (the task
    context, every group sharing it; the task, the group; the rollout, its rubric call, judge
    samples, re-asks and union) take the rest, last first; the rules get one if any is left.
    ``marks`` is empty outside the prompt form: the answer schema (output_config or the tool)
    comes before the system text in Anthropic's cache order and rubric and judge calls send
    different ones, so a mark would be a cache write (1.25x) nothing reads."""
    marked = [dict(m) for m in chat]
    room = 4 - (samples > 1)
    cuts: list[int] = []
    if marks and marked and marked[0].get("role") == "user" and \
            isinstance(marked[0].get("content"), str):
        text = marked[0]["content"]
        cuts = [m for m in dict.fromkeys(marks) if 0 < m < len(text)][-room:]
        blocks: list[dict[str, Any]] = []
        at = 0
        for cut in cuts:
            blocks.append({"type": "text", "text": text[at:cut],
                           "cache_control": {"type": "ephemeral"}})
            at = cut
        if blocks:
            marked[0]["content"] = [*blocks, {"type": "text", "text": text[at:]}]
    if samples > 1 and marked and isinstance(chat[-1].get("content"), str):
        # k samples are k calls with one prompt (no n on Anthropic): cache all of it.
        last = marked[-1]["content"]
        parts = last if isinstance(last, list) else [{"type": "text", "text": last}]
        parts[-1] = {**parts[-1], "cache_control": {"type": "ephemeral"}}
        marked[-1]["content"] = parts
    return marked, len(cuts)


def anthropic_choice(message: dict[str, Any]) -> Choice:
    blocks = message.get("content") or []
    tool = next((b for b in blocks if b.get("type") == "tool_use"), None)
    if tool is not None:  # the tool form: the answer is the forced tool's input
        stop = message.get("stop_reason")
        return Choice(text=json.dumps(tool.get("input"), ensure_ascii=False),
                      finish="length" if stop == "max_tokens" else "stop")
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text") or None
    stop = message.get("stop_reason")
    finish = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
              "refusal": "refusal"}.get(stop or "", stop or "stop")
    return Choice(text=text, finish=finish, refusal=text if finish == "refusal" else None)


def anthropic_usage(message: dict[str, Any]) -> Usage:
    """A message's usage; ``ReplyRefused`` for counts that cannot be (``token_count``)."""
    # Anthropic's input_tokens exclude cache reads and cache writes.
    u = counts(message, "usage")

    def count(name: str) -> int:
        return token_count(f"usage.{name}", u.get(name))

    return Usage(input_tokens=count("input_tokens"),
                 cached_tokens=count("cache_read_input_tokens"),
                 cache_write_tokens=count("cache_creation_input_tokens"),
                 output_tokens=count("output_tokens"),
                 reasoning_tokens=token_count("usage.output_tokens_details.thinking_tokens",
                                              counts(u, "output_tokens_details")
                                              .get("thinking_tokens")))
