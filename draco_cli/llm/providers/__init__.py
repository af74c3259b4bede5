"""Providers: one module per API, each turning an ``LLMRequest`` into one HTTP call.

Retries, caching, validation, cost and concurrency live once, in the client; a provider only
builds the request body, makes the call, normalises the reply and says which errors are worth
retrying (``Retryable``) or not (``RequestRejected``). A provider's module, and the SDK it
uses, is imported when a model of that provider is first made (``provider_class``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from draco_cli.llm.errors import ModelSpecError
from draco_cli.llm.providers.base import DEFAULT_MAX_REPLY_BYTES, STRUCTURED_FORMS, Provider

__all__ = ["REGISTRY", "STRUCTURED_FORMS", "Provider", "batches_by_default", "make_provider",
           "parse_model_id", "provider_class"]


@dataclass(frozen=True)
class Entry:
    module: str          # draco_cli.llm.providers.<module>
    cls: str
    sdk: str | None      # the package that module imports (named in the install hint)
    offers_batch: bool   # the provider's API has a batch API (read without importing it)


REGISTRY: dict[str, Entry] = {
    "openai": Entry("openai", "OpenAIProvider", "openai", True),
    "anthropic": Entry("anthropic", "AnthropicProvider", "anthropic", True),
    "replay": Entry("replay", "ReplayProvider", None, False),
    "mock": Entry("mock", "MockProvider", None, False),
}


def parse_model_id(model: str) -> tuple[str, str]:
    provider, sep, name = model.partition("/")
    if not sep or not name or provider not in REGISTRY:
        raise ModelSpecError(
            f"model {model!r}: write provider/model, provider one of {', '.join(REGISTRY)} "
            "(e.g. openai/gpt-4.1, anthropic/claude-sonnet-4-5, replay/runs/demo/llm_calls.sqlite,"
            " mock/any)")
    return provider, name


def batches_by_default(base_url: object, provider: object) -> bool:
    """Whether an offline command (``--batch`` left unset) uses the batch API: only a hosted
    API that has one (openai/, anthropic/), never a self-hosted or other server named by
    --base-url or DRACO_BASE_URL (most OpenAI-compatible servers have no batch endpoint), a
    fleet, or replay/. ``provider``: a provider, or its ``REGISTRY`` entry."""
    hosted = (base_url or os.environ.get("DRACO_BASE_URL")) is None
    return hosted and bool(getattr(provider, "offers_batch", False))


def provider_class(name: str) -> type[Provider]:
    """The provider class registered as ``name``, its module (and SDK) imported now."""
    entry = REGISTRY[name]
    try:
        module = importlib.import_module(f"{__name__}.{entry.module}")
    except ImportError as exc:
        if entry.sdk is None or exc.name != entry.sdk:
            raise
        raise ModelSpecError(f"{name}/ models need the '{entry.sdk}' package "
                             f"(pip install {entry.sdk})") from None
    cls: type[Provider] = getattr(module, entry.cls)
    return cls


def make_provider(model: str, *, base_url: str | None = None, concurrency: int = 16,
                  timeout: float = 120.0, structured_output: str | None = None,
                  system_role: bool = True, use_n: bool = True,
                  max_reply_bytes: int | None = None) -> Provider:
    """``max_reply_bytes``: the largest reply body a call takes (default 32 MiB)."""
    provider, name = parse_model_id(model)
    return provider_class(provider)(
        name, base_url=base_url or os.environ.get("DRACO_BASE_URL"), concurrency=concurrency,
        timeout=timeout, structured_output=structured_output, system_role=system_role,
        use_n=use_n,
        max_reply_bytes=DEFAULT_MAX_REPLY_BYTES if max_reply_bytes is None else max_reply_bytes)
