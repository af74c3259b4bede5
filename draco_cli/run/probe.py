"""A debugging aid of ``draco run``: the process's memory at each stage's start and end."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def rss_probe(where: str) -> None:
    """With ``DRACO_RSS_PROBE=1`` (a debugging aid, off by default): print the process's RSS
    and its peak since the last probe to stderr, then reset the peak (Linux ``clear_refs``),
    so each stage's own peak shows in one run."""
    if os.environ.get("DRACO_RSS_PROBE") != "1":
        return
    try:
        status = Path("/proc/self/status").read_text()
        kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in status.splitlines())
              if k in ("VmRSS", "VmHWM")}
        print(f"draco rss-probe {where}: rss {kb['VmRSS'] / 1024:.1f} MiB, peak since last "
              f"{kb['VmHWM'] / 1024:.1f} MiB", file=sys.stderr, flush=True)
        Path("/proc/self/clear_refs").write_text("5")
    except (OSError, KeyError, ValueError):
        pass
