"""A fleet of judges: several OpenAI-compatible endpoints serving one model, used as one.

Routing, back-off and the ``endpoint`` column: see docs/llm.md, "A fleet of judges"; the
tie-break, docs/decisions.md. A 400 is not retried elsewhere: every replica would reject it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from draco_cli.errors import UsageError
from draco_cli.llm.errors import Retryable
from draco_cli.llm.providers import Provider
from draco_cli.llm.types import LLMRequest, Reply

BACKOFF_BASE = 1.0
BACKOFF_CAP = 30.0


def base_urls(values: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The endpoints ``--base-url`` names: each value a URL, or a file listing URLs one per
    line (``#`` starts a comment). A value that is neither is refused, naming it."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        if "://" not in value and Path(value).is_file():
            for n, line in enumerate(Path(value).read_text().splitlines(), start=1):
                line = line.split("#", 1)[0].strip()
                if line:
                    out.append(_checked(line, f"--base-url {value} line {n}"))
        else:
            out.append(_checked(value, "--base-url"))
    if len(set(out)) != len(out):
        dup = next(u for u in out if out.count(u) > 1)
        raise UsageError(f"--base-url {dup}: listed twice")
    return out


def _checked(url: str, where: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{where}: {url!r} is not an http(s) URL (nor a file listing them)")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise UsageError(f"{where}: {url!r} has a bad port") from None
    return url


@dataclass
class Endpoint:
    url: str
    provider: Provider
    outstanding: int = 0
    served: int = 0
    failed: int = 0
    failures_in_a_row: int = 0
    down_until: float = 0.0
    seconds: float | None = None   # moving average of its answered calls' wall time

    def fail(self) -> None:
        self.failed += 1
        self.failures_in_a_row += 1
        self.down_until = time.monotonic() + min(
            BACKOFF_CAP, BACKOFF_BASE * 2 ** (self.failures_in_a_row - 1))

    def succeed(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else 0.8 * self.seconds + 0.2 * seconds
        self.served += 1
        self.failures_in_a_row = 0
        self.down_until = 0.0


class EndpointPool(Provider):
    """One provider over several endpoints (see docs/llm.md, "A fleet of judges")."""

    def __init__(self, endpoints: list[tuple[str, Provider]]) -> None:
        self.endpoints = [Endpoint(url, p) for url, p in endpoints]
        first = self.endpoints[0].provider
        self.name = first.name
        self.supports_n = first.supports_n
        self.form = getattr(first, "form", None)
        # told of every failed attempt (the call log holds the ones retried elsewhere too)
        self.on_failure: Callable[[LLMRequest, list[int], Retryable, str], None] | None = None

    def __getattr__(self, name: str) -> Any:
        # body(), batch clients and other provider details: the first endpoint's
        if name == "endpoints":
            raise AttributeError(name)
        return getattr(self.endpoints[0].provider, name)

    def _pick(self, tried: set[int]) -> Endpoint | None:
        now = time.monotonic()
        left = [e for k, e in enumerate(self.endpoints) if k not in tried]
        if not left:
            return None
        healthy = [e for e in left if e.down_until <= now]
        if healthy:
            return min(healthy, key=lambda e: (e.outstanding, e.seconds is not None,
                                               e.seconds or 0.0, e.served + e.failed))
        if tried:
            return None   # the rest are backed off: the client waits, then tries again
        return min(left, key=lambda e: e.down_until)   # all down: probe the first back

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        tried: set[int] = set()
        last: Retryable | None = None
        while True:
            ep = self._pick(tried)
            if ep is None:
                assert last is not None
                raise last
            tried.add(self.endpoints.index(ep))
            ep.outstanding += 1
            start = time.monotonic()
            try:
                reply = await ep.provider.complete(req, messages, samples)
            except Retryable as exc:
                ep.fail()
                exc.args = (f"{exc.args[0] if exc.args else exc} [{ep.url}]",)
                last = exc
                if self.on_failure is not None:
                    self.on_failure(req, samples, exc, ep.url)
                    exc.logged = True
                continue
            finally:
                ep.outstanding -= 1
            ep.succeed(time.monotonic() - start)
            reply.endpoint = ep.url
            return reply

    async def close(self) -> None:
        for e in self.endpoints:
            await e.provider.close()
