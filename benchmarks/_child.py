"""Shared by the benchmarks: run code or a command in a fresh process, get its output and its
own peak RSS.

Why a launcher: Linux carries a process's RSS high-water mark through ``fork`` (the child's
memory map starts as a copy of the parent's, high-water mark included) and through ``execve``
(into the maxrss that ``wait4`` reports). A child forked straight from a benchmark that has just
generated a large input would report the benchmark's own peak as its floor. So the measured
process is forked by a small launcher that was itself started fresh (``python -S``): its
``wait4`` sees the measured process's peak and nothing of ours.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

_LAUNCHER = """import os, sys
report = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    os.close(report)
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
os.write(report, b"%d %d" % (os.waitstatus_to_exitcode(status), usage.ru_maxrss))
"""


def run_measured(argv: Sequence[str], **popen: Any) -> tuple[int, float, Any, Any]:
    """Run ``argv`` (its first item an executable's path) to the end: (exit code, its own peak
    RSS in MiB, stdout, stderr — as ``subprocess.Popen(**popen).communicate()`` gives them)."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, str(w), *argv],
                                pass_fds=(w,), **popen)
    finally:
        os.close(w)
    out, err = proc.communicate()
    with os.fdopen(r, "rb") as f:
        report = f.read().split()
    if proc.returncode or len(report) != 2:
        raise SystemExit(f"benchmark launcher failed (exit {proc.returncode})")
    return int(report[0]), int(report[1]) / 1024, out, err


def run_child(code: str, *args: str, source: str | None = None) -> tuple[str, float]:
    """(what the child printed, its own peak RSS in MiB); ``source`` puts another
    ``draco_cli`` first on the child's path."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    # ``python -c`` puts the working folder first on the path
    code_rc, peak, out, _ = run_measured([sys.executable, "-c", code, *args],
                                         stdout=subprocess.PIPE, text=True,
                                         cwd=source or REPO, env=env)
    if code_rc:
        raise SystemExit(f"benchmark child failed (exit {code_rc})")
    return out, peak
