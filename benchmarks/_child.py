"""Shared by the benchmarks: run code in a fresh interpreter, get its output and peak RSS."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_child(code: str, *args: str) -> tuple[str, float]:
    """(what the child printed, its own peak RSS in MiB from wait4)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        os.dup2(w, 1)
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-c", code, *args])
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status, usage = os.wait4(pid, 0)
    if status:
        raise SystemExit(f"benchmark child failed (status {status})")
    return out, usage.ru_maxrss / 1024
