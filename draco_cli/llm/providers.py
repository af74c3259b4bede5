"""Providers: one small class per API, each turning an ``LLMRequest`` into one HTTP call.

Retries, caching, validation, cost and concurrency live once, in ``client.py``; a provider
only builds the request body, calls its SDK (imported lazily), normalises the reply and says
which errors are worth retrying. SDK-level retries are off so every attempt is ours to count.
"""

from __future__ import annotations

import os
import time
from typing import Any

from draco_cli.llm.errors import LLMError, ModelSpecError, ReplayMiss
from draco_cli.llm.types import Choice, LLMRequest, Reply, Usage

PROVIDERS = ("openai", "anthropic", "replay")


class Retryable(Exception):
    """A failure worth another attempt (429, 5xx, timeout, dropped connection)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def parse_model_id(model: str) -> tuple[str, str]:
    provider, sep, name = model.partition("/")
    if not sep or not name or provider not in PROVIDERS:
        raise ModelSpecError(
            f"model {model!r}: write provider/model, provider one of {', '.join(PROVIDERS)} "
            "(e.g. openai/gpt-4.1, anthropic/claude-sonnet-4-5, replay/runs/demo/llm_calls.sqlite)")
    return provider, name


def _retry_after(exc: Any) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    value = headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _split_system(messages: list[dict[str, str]]) -> tuple[str | None, list[dict[str, str]]]:
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    return system, [m for m in messages if m["role"] != "system"]


def _http_client(sdk, concurrency: int, timeout: float):
    """One long-lived client per endpoint on the SDK's aiohttp transport, its pool sized to the
    concurrency (the SDK's own transport if the aiohttp extra is missing)."""
    import httpx2

    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    try:
        return sdk.DefaultAioHttpClient(limits=limits, timeout=timeout)
    except RuntimeError:
        return sdk.DefaultAsyncHttpxClient(limits=limits, timeout=timeout)


# Status codes worth another attempt besides 429 and 5xx (529 = Anthropic "overloaded").
RETRY_STATUS = (408, 409, 425, 529)


async def _post_json(sdk, client, path: str, body: dict, label: str) -> tuple[dict, float]:
    """POST through the SDK's public low-level ``post`` (its transport, auth and typed errors,
    without re-walking the request through typed params and the reply through pydantic, which
    cost more CPU than everything else per call at high concurrency). Returns (JSON reply,
    latency); failures worth retrying become ``Retryable``, the rest ``LLMError``. Both SDKs
    name their exceptions alike."""
    import httpx2

    start = time.perf_counter()
    try:
        raw = await client.post(path, body=body, cast_to=httpx2.Response)
    except (sdk.RateLimitError, sdk.InternalServerError) as exc:
        raise Retryable(f"HTTP {exc.status_code}", _retry_after(exc)) from None
    except sdk.APITimeoutError:
        raise Retryable("timeout") from None
    except sdk.APIConnectionError as exc:
        raise Retryable(f"connection error ({type(exc.__cause__).__name__})") from None
    except sdk.APIStatusError as exc:
        if exc.status_code in RETRY_STATUS:
            raise Retryable(f"HTTP {exc.status_code}", _retry_after(exc)) from None
        raise LLMError(f"{label}: HTTP {exc.status_code}: {_brief(exc)}") from None
    latency = time.perf_counter() - start
    try:
        return raw.json(), latency
    except ValueError:
        raise Retryable("the server sent a body that is not JSON") from None


class OpenAIProvider:
    """OpenAI's API, or any OpenAI-compatible server (vLLM, SGLang, Ollama, llama.cpp)."""

    name = "openai"
    supports_n = True

    def __init__(self, model: str, *, base_url: str | None, concurrency: int, timeout: float):
        try:
            import openai
        except ImportError:  # pragma: no cover - declared dependency
            raise ModelSpecError("openai/ models need the 'openai' package") from None
        self._openai = openai
        self.model = model
        self.self_hosted = base_url is not None
        http = _http_client(openai, concurrency, timeout)
        api_key = None
        if self.self_hosted and not os.environ.get("OPENAI_API_KEY"):
            api_key = "none"  # local servers take any key; the SDK insists on one
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                         timeout=timeout, http_client=http)

    def body(self, req: LLMRequest, messages: list[dict[str, str]], n: int) -> dict[str, Any]:
        s = req.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": req.schema_name, "schema": req.schema(), "strict": True}},
        }
        # Self-hosted servers take max_tokens; OpenAI's own reasoning models need the newer name.
        body["max_tokens" if self.self_hosted else "max_completion_tokens"] = s.max_tokens
        if n > 1:
            body["n"] = n
        for k in ("temperature", "top_p", "seed"):
            if getattr(s, k) is not None:
                body[k] = getattr(s, k)
        if self.self_hosted:
            # Qwen3-style templates switch thinking with a template argument (vLLM, SGLang).
            body["extra_body"] = {"chat_template_kwargs": {"enable_thinking": s.thinking}}
        elif s.thinking:
            body["reasoning_effort"] = "medium"
        return body

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        body = self.body(req, messages, len(samples))
        wire = dict(body)
        wire.update(wire.pop("extra_body", {}))
        data, latency = await _post_json(self._openai, self.client, "/chat/completions", wire,
                                         f"openai/{self.model}")
        reply = openai_reply(data, wire)
        reply.latency_s = latency
        return reply

    async def close(self) -> None:
        await self.client.close()


class AnthropicProvider:
    """Anthropic's Messages API with structured output (``output_config.format``)."""

    name = "anthropic"
    supports_n = False

    def __init__(self, model: str, *, base_url: str | None, concurrency: int, timeout: float):
        try:
            import anthropic
        except ImportError:  # pragma: no cover - declared dependency
            raise ModelSpecError("anthropic/ models need the 'anthropic' package") from None
        self._anthropic = anthropic
        self.model = model
        http = _http_client(anthropic, concurrency, timeout)
        self.client = anthropic.AsyncAnthropic(base_url=base_url, max_retries=0, timeout=timeout,
                                               http_client=http)

    def body(self, req: LLMRequest, messages: list[dict[str, str]], n: int = 1) -> dict[str, Any]:
        s = req.sampling
        system, chat = _split_system(messages)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": s.max_tokens,
            "messages": chat,
            "output_config": {"format": {"type": "json_schema", "schema": req.schema()}},
        }
        if system:
            body["system"] = system
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
        message, latency = await _post_json(self._anthropic, self.client, "/v1/messages", body,
                                            f"anthropic/{self.model}")
        return Reply([anthropic_choice(message)], anthropic_usage(message.get("usage") or {}),
                     body, message, latency)

    async def close(self) -> None:
        await self.client.close()


def openai_reply(body: dict, request_body: dict, batch_id: str | None = None) -> Reply:
    """A chat-completion JSON body (online or from a batch file) as a Reply."""
    choices = []
    for c in sorted(body.get("choices") or [], key=lambda c: c.get("index", 0)):
        msg = c.get("message") or {}
        refusal = msg.get("refusal")
        choices.append(Choice(text=msg.get("content"),
                              finish="refusal" if refusal else c.get("finish_reason") or "stop",
                              refusal=refusal))
    u = body.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    # OpenAI's prompt_tokens include the cached ones; completion_tokens include reasoning.
    usage = Usage(input_tokens=(u.get("prompt_tokens") or 0) - cached, cached_tokens=cached,
                  output_tokens=u.get("completion_tokens") or 0,
                  reasoning_tokens=(u.get("completion_tokens_details") or {})
                  .get("reasoning_tokens") or 0)
    return Reply(choices, usage, request_body, body, 0.0, batch_id)


def anthropic_choice(message: dict) -> Choice:
    text = "".join(b.get("text", "") for b in message.get("content") or []
                   if b.get("type") == "text") or None
    stop = message.get("stop_reason")
    finish = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
              "refusal": "refusal"}.get(stop or "", stop or "stop")
    return Choice(text=text, finish=finish, refusal=text if finish == "refusal" else None)


def anthropic_usage(u: dict) -> Usage:
    # Anthropic's input_tokens exclude cache reads and cache writes.
    details = u.get("output_tokens_details") or {}
    return Usage(input_tokens=u.get("input_tokens") or 0,
                 cached_tokens=u.get("cache_read_input_tokens") or 0,
                 cache_write_tokens=u.get("cache_creation_input_tokens") or 0,
                 output_tokens=u.get("output_tokens") or 0,
                 reasoning_tokens=details.get("thinking_tokens") or 0)


class ReplayProvider:
    """Answers only from a recorded call log; anything else is an error (offline demos, tests)."""

    name = "replay"
    supports_n = True

    def __init__(self, path: str) -> None:
        from draco_cli.llm.calllog import ReplayLog

        self.model = path
        self.log = ReplayLog(path)

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        choices = []
        for i in samples:
            hit = self.log.answers.get((req.hash(i, None), i))
            if hit is None:
                raise ReplayMiss(
                    f"replay/{self.model}: no recorded answer for this {req.phase} request "
                    f"(key {req.key!r}, sample {i}): the recorded run asked fewer samples, or "
                    "its prompt, schema, sampling or template version differ from this one")
            choices.append(Choice(text=hit.answer_text, finish="stop"))
        return Reply(choices, Usage(), {"replay": True}, {"replay": True}, 0.0)

    async def close(self) -> None:
        return None


def make_provider(model: str, *, base_url: str | None = None, concurrency: int = 16,
                  timeout: float = 120.0):
    provider, name = parse_model_id(model)
    base_url = base_url or os.environ.get("DRACO_BASE_URL")
    if provider == "openai":
        return OpenAIProvider(name, base_url=base_url, concurrency=concurrency, timeout=timeout)
    if provider == "anthropic":
        return AnthropicProvider(name, base_url=base_url, concurrency=concurrency,
                                 timeout=timeout)
    return ReplayProvider(name)


def _brief(exc: Any) -> str:
    """The server's error message, without any key it may quote back."""
    from draco_cli.llm.keys import scrub

    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return scrub(str(err["message"])[:300]) or ""
    return scrub(str(getattr(exc, "message", exc))[:300]) or ""
