"""Keeping the cyclic garbage collector off the event loop's back while calls run."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_calm = [0]   # runs in progress under ``calm_collector`` (threads and nested sessions count)
_calm_lock = threading.Lock()
_saved_threshold: list[tuple[int, ...]] = []
YOUNG_THRESHOLD = 10_000   # allocations between young collections during a run (default 700)


@contextmanager
def calm_collector() -> Iterator[None]:
    """While calls run, keep the cyclic garbage collector off the event loop's back. A run
    allocates tasks, futures and parsed replies fast enough to set off ~15 young and one or
    two full collections per 2,000 calls, and each full one walked the whole heap (the SDKs'
    thousands of classes, pydantic's schemas, the caller's tables): 40-120 ms of CPU per
    2,000 calls with the loop stopped, at concurrency 256 its longest pauses. So the objects
    that existed before the run are left out of the collector's passes (``gc.freeze``;
    handed back with ``gc.unfreeze`` when the last run ends) and the young generation is
    collected every 10,000 allocations instead of 700 (restored after). Objects made during
    the run are collected as before, only less often. A process that froze objects itself (a
    pre-forking server) or turned the collector off is left as it is."""
    with _calm_lock:
        mine = _calm[0] > 0 or (gc.isenabled() and gc.get_freeze_count() == 0)
        if mine:
            if _calm[0] == 0:
                gc.freeze()
                threshold = gc.get_threshold()
                _saved_threshold[:] = [threshold]
                gc.set_threshold(max(threshold[0], YOUNG_THRESHOLD), *threshold[1:])
            _calm[0] += 1
    try:
        yield
    finally:
        if mine:
            with _calm_lock:
                _calm[0] -= 1
                if _calm[0] == 0:
                    gc.set_threshold(*_saved_threshold.pop())
                    gc.unfreeze()
