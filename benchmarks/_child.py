"""Shared by the benchmarks: run code in a fresh interpreter, get its output and peak RSS."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_child(code: str, *args: str, source: str | None = None) -> tuple[str, float]:
    """(what the child printed, its own peak RSS in MiB from wait4); ``source`` puts another
    ``draco_cli`` first on the child's path."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        os.dup2(w, 1)
        os.chdir(source or REPO)  # ``python -c`` puts the working folder first on the path
        env = dict(os.environ)
        if source is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
        os.execve(sys.executable, [sys.executable, "-c", code, *args], env)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status, usage = os.wait4(pid, 0)
    if status:
        raise SystemExit(f"benchmark child failed (status {status})")
    return out, usage.ru_maxrss / 1024
