"""Concurrency that adapts to the server: keep in flight only as many calls as it serves in
parallel. See docs/llm.md, "Concurrency that adapts" (a round = as many completions as the
limit), and docs/decisions.md on closing a timed-out call's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

GAIN = 1.2      # a doubling must raise throughput by 20% to count
REPROBE = 20    # rounds at a held level before trying one level up again
ROUND_MIN = 4   # completions per round at least (one call's latency is too noisy a measure)


class AdaptiveLimit:
    def __init__(self, maximum: int, start: int = 1, adaptive: bool = True) -> None:
        self.maximum = max(1, maximum)
        self.adaptive = adaptive
        self.limit = min(self.maximum, start) if adaptive else self.maximum
        self.in_flight = 0
        # Callers waiting for a slot, first come first served. A freed slot is handed to the
        # head waiter directly (one wake-up per slot, not every waiter re-checking a condition:
        # with thousands of calls queued that herd cost more CPU than the calls themselves).
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._round_start = time.monotonic()
        self._round_done = 0
        self._last: tuple[int, float] | None = None   # (limit, throughput) of the last round
        self._held = 0
        self._growing = True

    def _free(self) -> bool:
        return self.in_flight < self.limit

    def _wake(self) -> None:
        while self._waiters and self._free():
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1   # taken on the waiter's behalf
                fut.set_result(None)

    # ``async with limit:`` holds one slot for the call inside (the limit is its own context
    # manager: every call enters one, and a generator-based one cost a generator and a wrapper)
    async def __aenter__(self) -> None:
        if not self._waiters and self._free():
            self.in_flight += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.in_flight -= 1   # granted, then cancelled before use: give it back
                self._wake()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.in_flight -= 1
        self._wake()

    def completed(self) -> None:
        """One call answered: count it toward the round, adapt at the end of a round."""
        if not self.adaptive:
            return
        self._round_done += 1
        if self._round_done < max(self.limit, ROUND_MIN):
            return
        now = time.monotonic()
        rate = self._round_done / max(now - self._round_start, 1e-6)
        self._round_start, self._round_done = now, 0
        last = self._last
        self._last = (self.limit, rate)
        if self._growing:
            if last is not None and self.limit > last[0] and rate < last[1] * GAIN:
                self.limit = last[0]            # no gain from the doubling: back, and hold
                self._last = last
                self._growing = False
            elif self.limit < self.maximum:
                self.limit = min(self.maximum, self.limit * 2)
        else:
            self._held += 1
            if self._held >= REPROBE and self.limit < self.maximum:
                self._held = 0
                self._growing = True
                self.limit = min(self.maximum, self.limit * 2)
        self._wake()   # a raised limit frees slots for calls already waiting

    def timed_out(self) -> None:
        """A call timed out: halve the limit. The abandoned call holds no slot: its connection
        was closed, which a server that aborts on disconnect (vLLM, llama.cpp's llama-server)
        takes as the end of it, and its retry goes out at once."""
        if self.adaptive:
            self.limit = max(1, self.limit // 2)
            self._growing = False
            self._held = 0

