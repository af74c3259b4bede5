"""Allocator tuning for the ``draco`` command's own process (the library never calls it).

``tune_allocator`` raises glibc's mmap and trim thresholds once at start-up (numpy's
temporaries paid first-touch page faults again each time); ``release_polars_pages`` and
``release_freed_memory`` serve ``draco run``'s memory (``benchmarks/bench_run_memory.py``
prints its per-stage figures). Measurements: docs/decisions.md, "Credit" and the issue 19
`draco run` sections.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False
# polars' jemalloc: freed pages go back to the system at once instead of after ~10 s
POLARS_MALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"


def tune_allocator(release_polars_pages: bool = False) -> bool:
    """Apply once; True if glibc accepted the settings (False elsewhere, harmlessly)."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    if release_polars_pages and "polars" not in sys.modules:  # read when polars' jemalloc starts
        os.environ.setdefault("_RJEM_MALLOC_CONF", POLARS_MALLOC_CONF)
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
                  and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31) == 1)
    except (OSError, AttributeError):  # not glibc (musl, ...)
        ok = False
    _done = ok
    return ok


def release_freed_memory() -> None:
    """Hand memory freed by earlier work back to the system before a phase that allocates
    afresh: garbage collected, Arrow's pool's free memory released, glibc's heap trimmed
    (a no-op without ``tune_allocator``). Why, and its cost: docs/decisions.md, "`draco run`'s
    100k peak: freed heap handed back before the judge reads"."""
    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    if _done:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
