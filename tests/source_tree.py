"""Parse draco's own source for tests that check its structure."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """``ast.parse`` with the collector paused. On CPython 3.11.7 (CI's Python) a finalizer that
    runs mid-parse and formats a traceback, which parses source itself, broke the parser's
    recursion bookkeeping: "SystemError: AST constructor recursion depth mismatch"
    (python/cpython gh-106905)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text())
    finally:
        if was_enabled:
            gc.enable()
