"""The retry policy of every exchange with an API (a single call, a batch upload or poll),
written once. Waits and limits: docs/llm.md, "Throughput"; a refused connection is retried
only twice (no server is listening)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from draco_cli.llm.errors import LLMError, Retryable
from draco_cli.llm.keys import scrub

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 6
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    wait_cap: float | None = None   # the longest server-sent wait honoured (--timeout)

    def delay(self, exc: Retryable, attempt: int, what: str) -> float:
        """Seconds to wait after attempt ``attempt`` (from 0) failed with ``exc``; an
        ``LLMError`` naming ``what`` when no attempt is left."""
        limit = 2 if exc.kind == "refused" else self.max_retries
        if attempt >= limit:
            raise LLMError(f"{what}: giving up after {attempt + 1} attempts "
                           f"({scrub(str(exc))})") from None
        jitter = random.uniform(1.0, 1.25)  # spread the herd
        if exc.retry_after is None:
            return min(self.backoff_cap, self.backoff_base * 2.0 ** attempt) * jitter
        # the server's own wait (Retry-After: 1000000, or inf), within the call's timeout
        wait = max(exc.retry_after, 0.0) * jitter
        return wait if self.wait_cap is None else min(wait, self.wait_cap)

    async def run(self, call: Callable[[int], Awaitable[T]], what: str) -> T:
        """``await call(attempt)`` until it returns, retrying ``Retryable`` failures."""
        attempt = 0
        while True:
            try:
                return await call(attempt)
            except Retryable as exc:
                wait = self.delay(exc, attempt, what)
            attempt += 1
            await asyncio.sleep(wait)
