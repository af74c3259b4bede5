"""``openai/``: OpenAI's API, or any OpenAI-compatible server (vLLM, SGLang, Ollama,
llama.cpp). Single calls go out on draco's aiohttp route (``http.AioHttpPost``); batch files,
and calls whose key is not static or that go through a proxy, through the openai SDK."""

from __future__ import annotations

import json
import os
from typing import Any

import openai

from draco_cli.llm.errors import LLMError, ReplyRefused, Retryable
from draco_cli.llm.providers.base import (DEFAULT_MAX_REPLY_BYTES, OPENAI_FORMS, BatchState,
                                          Provider, fold_system, schema_instruction,
                                          with_instruction)
from draco_cli.llm.providers.http import AioHttpPost, env_proxy
from draco_cli.llm.providers.sdk import get_json, get_text, http_client, jsonl, mapped, post_json
from draco_cli.llm.types import Choice, LLMRequest, Reply, Usage, counts, token_count


def direct_headers(client: openai.AsyncOpenAI, timeout: float) -> dict[str, str] | None:
    """The headers the SDK client sends with every request, or None when its authentication
    is more than a static key (workload identity, a key provider, a token cache): those calls
    stay on the SDK path, which knows how to refresh them."""
    auth = dict(client.auth_headers)
    if not auth or client.custom_auth is not None or getattr(client, "_api_key_provider", None):
        return None
    headers = {k: v for k, v in client.default_headers.items() if isinstance(v, str)}  # no Omit
    headers.update(auth)
    headers["x-stainless-retry-count"] = "0"
    headers["x-stainless-read-timeout"] = str(float(timeout))
    return headers


class OpenAIProvider(Provider):
    """OpenAI's API, or any OpenAI-compatible server (vLLM, SGLang, Ollama, llama.cpp)."""

    name = "openai"
    supports_n = True
    forms = OPENAI_FORMS
    default_form = "json-schema"

    def __init__(self, model: str, *, base_url: str | None, concurrency: int, timeout: float,
                 structured_output: str | None = None, system_role: bool = True,
                 use_n: bool = True, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES):
        self._openai = openai
        self.model = model
        self.self_hosted = base_url is not None
        # OpenAI's prompt cache puts a structured-output schema ahead of the messages, and
        # each stage sends its own: only the prompt form lets a rollout's calls share a cached
        # head (docs/decisions.md). Self-hosted servers constrain decoding without it.
        auto = (structured_output or "auto") == "auto"
        self.form = "prompt" if auto and not self.self_hosted else self._form(structured_output)
        self.system_role = system_role
        self.supports_n = use_n
        api_key = None
        if not os.environ.get("OPENAI_API_KEY"):
            if not self.self_hosted:
                raise LLMError(f"openai/{model}: OPENAI_API_KEY is not set (or use --base-url "
                               "for a self-hosted server, which needs no key)")
            api_key = "none"  # local servers take any key; the SDK insists on one
        http = http_client(openai, concurrency, timeout, max_reply_bytes)
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                         timeout=timeout, http_client=http)
        # absolute, so the SDK does not parse and merge the base URL again on every call
        self._chat_url = f"{self.client.base_url}chat/completions"
        # single calls: draco's aiohttp route unless the key is not static or a proxy is set
        headers = None if env_proxy(self._chat_url) else direct_headers(self.client, timeout)
        self.direct = None if headers is None else AioHttpPost(headers, concurrency, timeout,
                                                               max_reply_bytes)

    def body(self, req: LLMRequest, messages: list[dict[str, str]], n: int) -> dict[str, Any]:
        """The JSON body of one chat completion (single call or batch line)."""
        s = req.sampling
        if self.form == "prompt":
            messages = with_instruction(messages, schema_instruction(req.schema()))
        if not self.system_role:
            messages = fold_system(messages)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.form in ("json-schema", "json-schema-loose"):
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": req.schema_name, "schema": req.schema(),
                "strict": self.form == "json-schema"}}
        elif self.form == "json-object":
            body["response_format"] = {"type": "json_object", "schema": req.schema()}
        # Self-hosted servers take max_tokens; OpenAI's own reasoning models need the newer name.
        body["max_tokens" if self.self_hosted else "max_completion_tokens"] = s.max_tokens
        if n > 1:
            body["n"] = n
        for k in ("temperature", "top_p", "seed"):
            if getattr(s, k) is not None:
                body[k] = getattr(s, k)
        if self.self_hosted:
            # Qwen3-style templates switch thinking with a template argument (vLLM, SGLang).
            body["chat_template_kwargs"] = {"enable_thinking": s.thinking}
        elif s.thinking:
            body["reasoning_effort"] = "medium"
        if self.form == "vllm":
            body["structured_outputs"] = {"json": req.schema()}
        return body

    def wire(self, req: LLMRequest, messages: list[dict[str, str]],
             n: int) -> tuple[dict[str, Any], str]:
        """The body of one call and its JSON as sent."""
        body = self.body(req, messages, n)
        return body, wire_json(body, req)

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        wire, text = self.wire(req, messages, len(samples))
        label = f"openai/{self.model}"
        received = None
        if self.direct is not None:
            data, latency, received = await self.direct.post(self._chat_url, text.encode(),
                                                             label)
        else:  # sent as bytes: the SDK neither copies nor encodes the body again
            data, latency = await post_json(self._openai, self.client, self._chat_url,
                                            text.encode(), label)
        if not isinstance(data, dict):
            raise Retryable("the server sent JSON that is not a chat completion object")
        reply = openai_reply(data, wire)
        reply.latency_s = latency
        reply.request_text = text
        reply.response_text = received
        return reply

    async def close(self) -> None:
        if self.direct is not None:
            await self.direct.close()
        await self.client.close()

    # -- OpenAI Batch: a JSONL file of /v1/chat/completions bodies, one output file ----------

    offers_batch = True
    BATCH_ENDED = ("completed", "failed", "expired", "cancelled")

    def batch_request(self, req: LLMRequest, samples: list[int]) -> dict[str, Any]:
        return self.body(req, req.messages, len(samples))

    async def submit_batch(self, lines: dict[str, dict[str, Any]]) -> str:
        payload = "".join(json.dumps({"custom_id": cid, "method": "POST",
                                      "url": "/v1/chat/completions", "body": body}) + "\n"
                          for cid, body in lines.items()).encode()
        sdk, label = self._openai, self._label("uploading the batch file")
        f = await mapped(sdk, label, lambda: self.client.files.create(
            file=("draco-batch.jsonl", payload), purpose="batch"))
        batch, _ = await post_json(sdk, self.client, "/batches", {
            "input_file_id": f.id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}, self._label("creating the batch"))
        return str(batch["id"])

    async def poll_batch(self, batch_id: str) -> BatchState:
        b = await get_json(self._openai, self.client, f"/batches/{batch_id}",
                           self._label(f"polling batch {batch_id}"))
        status = b.get("status") or "unknown"
        return BatchState(batch_id, status, status in self.BATCH_ENDED,
                          dict(b.get("request_counts") or {}))

    async def batch_results(self, batch_id: str) -> dict[str, Reply]:
        b = await get_json(self._openai, self.client, f"/batches/{batch_id}",
                           self._label(f"reading batch {batch_id}"))
        if not b.get("output_file_id"):
            return {}  # failed, expired or cancelled before any line was answered
        text = await get_text(self._openai, self.client, f"/files/{b['output_file_id']}/content",
                              self._label(f"reading the results of batch {batch_id}"))
        out = {}
        for item in jsonl(text):
            resp = item.get("response") or {}
            if resp.get("status_code") == 200 and item.get("custom_id"):
                try:
                    out[item["custom_id"]] = openai_reply(resp["body"], {}, batch_id)
                except ReplyRefused:
                    continue   # a line with impossible counts: unanswered, asked again
        return out


# json.dumps with arguments builds an encoder per call; this one is built once (same output)
_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def wire_json(wire: dict[str, Any], req: LLMRequest) -> str:
    """The request body as JSON, serialised once: the request's messages, when sent as they
    are, are spliced in from the JSON its cache key already hashed."""
    if wire.get("messages") is not req.messages:
        return _compact(wire)
    rest = _compact({k: v for k, v in wire.items() if k != "messages"})
    return (rest[:-1] + ("," if len(wire) > 1 else "") + '"messages":' + req.messages_json()
            + "}")


def openai_reply(body: dict[str, Any], request_body: dict[str, Any],
                 batch_id: str | None = None) -> Reply:
    """A chat-completion JSON body (online or from a batch file) as a Reply."""
    choices = []
    for c in sorted(body.get("choices") or [], key=lambda c: c.get("index", 0)):
        msg = c.get("message") or {}
        refusal = msg.get("refusal")
        choices.append(Choice(text=msg.get("content"),
                              finish="refusal" if refusal else c.get("finish_reason") or "stop",
                              refusal=refusal))
    u = counts(body, "usage")
    prompt = token_count("usage.prompt_tokens", u.get("prompt_tokens"))
    cached = token_count("usage.prompt_tokens_details.cached_tokens",
                         counts(u, "prompt_tokens_details").get("cached_tokens"))
    # OpenAI's prompt_tokens include the cached ones; completion_tokens include reasoning.
    usage = Usage(input_tokens=token_count("usage.prompt_tokens less its cached_tokens",
                                           prompt - cached), cached_tokens=cached,
                  output_tokens=token_count("usage.completion_tokens",
                                            u.get("completion_tokens")),
                  reasoning_tokens=token_count(
                      "usage.completion_tokens_details.reasoning_tokens",
                      counts(u, "completion_tokens_details").get("reasoning_tokens")))
    return Reply(choices, usage, request_body, body, 0.0, batch_id)
