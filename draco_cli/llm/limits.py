"""Requests and tokens per minute (``--rpm``, ``--tpm``)."""

from __future__ import annotations

import asyncio
import time


class RateLimiter:
    """Requests and tokens per minute, as a pair of token buckets holding one second's worth
    (so a start-up burst cannot spend a whole minute's allowance at once)."""

    def __init__(self, rpm: float | None, tpm: float | None) -> None:
        self.rpm, self.tpm = rpm, tpm
        self._req_cap = max(1.0, (rpm or 0) / 60)
        self._tok_cap = max(1.0, (tpm or 0) / 60)
        self._req = self._req_cap
        self._tok = self._tok_cap
        self._t = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self, tokens: int) -> None:
        if not self.rpm and not self.tpm:
            return
        async with self._lock:
            while True:
                now = time.monotonic()
                dt, self._t = now - self._t, now
                if self.rpm:
                    self._req = min(self._req_cap, self._req + dt * self.rpm / 60)
                if self.tpm:
                    self._tok = min(self._tok_cap, self._tok + dt * self.tpm / 60)
                need_r = 0 if not self.rpm or self._req >= 1 else (1 - self._req) * 60 / self.rpm
                cap = min(tokens, self._tok_cap) if self.tpm else 0
                need_t = 0 if not self.tpm or self._tok >= cap else (cap - self._tok) * 60 / self.tpm
                wait = max(need_r, need_t)
                if wait <= 0:
                    if self.rpm:
                        self._req -= 1
                    if self.tpm:
                        self._tok -= cap
                    return
                await asyncio.sleep(wait)
