"""What can go wrong with a call log file, said in one line: a damaged or truncated file (with
how to recover), a write SQLite refuses, and a transient read error (retried, never called
corruption)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from draco_cli.errors import DracoError, InputError

T = TypeVar("T")

RECOVER = ("restore it from a copy, or move it aside to start a new log (the calls it answered "
           "would then be paid for again)")


def _bad(path: Path, why: str) -> InputError:
    return InputError(f"{why}: {RECOVER}", file=str(path))


# SQLite's codes for a file that is really damaged; anything else (busy, locked, an I/O error
# while another process reads the write-ahead log) is transient and says so.
_DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
_RETRIES = (0.05, 0.2, 0.5, 1.0, 2.0)


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name:
        return name.startswith(_DAMAGED)
    text = str(exc)
    return "malformed" in text or "not a database" in text or "no calls table" in text


def _unreadable(path: Path, exc: sqlite3.DatabaseError) -> BaseException:
    """The error for a failed read: corruption only when SQLite reports damage."""
    if _damaged(exc):
        name = getattr(exc, "sqlite_errorname", "") or ""
        if name.startswith("SQLITE_NOTADB") or "not a database" in str(exc):
            return _bad(path, f"not a SQLite call log ({exc})")
        return _bad(path, f"corrupt call log ({exc})")
    return DracoError(f"{path}: could not read the call log ({exc}) — a transient error, "
                      "often another process reading it; the log is not damaged: rerun the "
                      "same command (its answers are kept)")


def retry_read(path: Path, read: Callable[[], T]) -> T:
    """``read()`` retried over a few seconds while SQLite reports a transient error (another
    process holding the log, a WAL read racing a checkpoint); then the one-line error."""
    for wait in (*_RETRIES, None):
        try:
            return read()
        except sqlite3.DatabaseError as exc:
            if _damaged(exc) or wait is None:
                raise _unreadable(path, exc) from None
            time.sleep(wait)
    raise AssertionError("unreachable")


def _write_failed(path: Path, exc: BaseException) -> BaseException:
    """SQLite's own write failures ("database or disk is full", a read-only or locked file) as
    one line naming the call log; anything else is passed through unchanged."""
    if not isinstance(exc, sqlite3.OperationalError):
        return exc
    name = getattr(exc, "sqlite_errorname", "")
    if name == "SQLITE_FULL" or "disk is full" in str(exc):
        why = ("database or disk is full (free space and rerun: the calls already in the log "
               "are kept and not paid for again)")
    elif name.startswith("SQLITE_READONLY") or "readonly" in str(exc):
        why = "the file or its folder is read-only"
    else:
        why = str(exc)
    return DracoError(f"{path}: cannot write the call log: {why}")


def _check_file(path: Path) -> None:
    """Refuse anything that is not a whole call log (docs/llm.md, "The call log").

    Only ``stat`` here: SQLite reads the header when the caller's connection first reads (a
    file that is not SQLite is SQLITE_NOTADB; one shorter than its header's page count,
    without a WAL holding the rest, SQLITE_CORRUPT), and ``_unreadable`` names both. The file
    is never opened outside SQLite: closing a descriptor of it drops every POSIX lock this
    process holds on it, its live connections' included, and the next process to close the
    log then takes itself for the last one and deletes the write-ahead log this process still
    commits into (those answers reach no other reader, and are lost if this process is
    killed)."""
    if path.exists() and path.stat().st_size == 0:
        raise _bad(path, "empty file where a call log should be (a truncated copy?)")
