"""The call log: every LLM call draco pays for, which is also its cache and its resume point.
See docs/llm.md, "The call log = cache = resume point".

One background thread batches rows into transactions: a commit per call would cap throughput
at a few hundred calls/s, and one writer avoids lock fights. Parquet export:
``llm.export.export_parquet``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draco_cli.errors import InputError
from draco_cli.llm.calllog_errors import (_bad, _check_file, _unreadable,
                                          _write_failed, retry_read)

FLUSH_SECONDS = 0.1
FLUSH_ROWS = 500

# PRAGMA user_version of the call log. 1 = the first layout (written before versions were
# stamped, user_version 0); 2 = the same tables, stamped; 3 = calls.endpoint (the base URL of
# the fleet member that served or failed a call). A log from a newer draco is refused.
SCHEMA_VERSION = 3

SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY,
    request_hash TEXT,          -- model, messages, schema, sampling, template version, sample
    content_hash TEXT,          -- the same without the model (what replay/ looks up)
    sample INTEGER,             -- null for an HTTP attempt that produced no answer
    phase TEXT,
    key TEXT,                   -- the caller's label, e.g. the rollout id
    provider TEXT,
    model TEXT,
    attempt INTEGER,            -- 0 = first ask; re-asks after invalid answers count up
    status TEXT,                -- ok | invalid | truncated | refused | http_error | unanswered
    error TEXT,
    request TEXT,               -- the JSON body sent (never headers, never keys)
    response TEXT,              -- the JSON body received
    answer_text TEXT,           -- this sample's raw answer text
    parsed TEXT,                -- the validated answer (status ok)
    input_tokens INTEGER,       -- uncached input
    cached_tokens INTEGER,
    cache_write_tokens INTEGER,
    output_tokens INTEGER,      -- reasoning included
    reasoning_tokens INTEGER,
    latency_s REAL,
    cost_usd REAL,
    batch_id TEXT,
    created_at TEXT,
    endpoint TEXT               -- with several --base-url: the one that served or failed it
);
CREATE INDEX IF NOT EXISTS calls_request ON calls(request_hash, sample, status);
CREATE INDEX IF NOT EXISTS calls_content ON calls(content_hash, sample, status);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    provider TEXT,
    model TEXT,
    phase TEXT,
    status TEXT,                -- submitted | done
    request_map TEXT,           -- custom_id -> [request_hash, samples]
    created_at TEXT
);
"""

COLUMNS = ("request_hash", "content_hash", "sample", "phase", "key", "provider", "model",
           "attempt", "status", "error", "request", "response", "answer_text", "parsed",
           "input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens",
           "reasoning_tokens", "latency_s", "cost_usd", "batch_id", "created_at", "endpoint")


@dataclass
class Recorded:
    """An answered call found in the log."""

    answer_text: str
    parsed: str


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextlib.contextmanager
def read_only(path: str | os.PathLike[str]) -> Iterator[tuple[sqlite3.Connection, set[str]]]:
    """A call log opened for reading (while a stage may still write it), with the columns its
    ``calls`` table has; a file that is not one (no such table, not SQLite) is a one-line error
    naming it, a transient SQLite error is retried (``retry_read``)."""
    p = Path(path)
    if not p.is_file():
        raise InputError("no such call log", file=str(path))
    conn = reader(p)
    try:
        have = retry_read(p, lambda: {row[1] for row in conn.execute("PRAGMA table_info(calls)")})
        if not have:
            raise InputError("not a draco call log (no calls table)", file=str(path))
        yield conn, have
    except sqlite3.DatabaseError as exc:
        raise InputError(f"not a draco call log ({exc})", file=str(path)) from None
    finally:
        conn.close()


def reader(path: Path) -> sqlite3.Connection:
    """A handle for reading a log a stage may be writing. A plain handle where the file and its
    folder are writable (draco's readers issue no write; SQLite may checkpoint on close, as for
    any reader): a mode=ro handle on a WAL database cannot rebuild the shared-memory index or
    recover the WAL, and fails with an I/O error while other processes use the log."""
    try:
        if os.access(path, os.W_OK) and os.access(path.parent, os.W_OK):
            return sqlite3.connect(path, check_same_thread=False, timeout=10.0)
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False,
                               timeout=10.0)
    except sqlite3.DatabaseError as exc:
        raise _unreadable(path, exc) from None


def _check_schema(conn: sqlite3.Connection, path: Path) -> None:
    """Refuses a file that is not a call log, or one from a newer draco; closes ``conn`` then."""
    def read() -> tuple[set[str], int]:
        return ({r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")},
                conn.execute("PRAGMA user_version").fetchone()[0])

    try:
        tables, version = retry_read(path, read)
        if tables and "calls" not in tables:
            raise _bad(path, "a SQLite file but not a draco call log (no calls table)")
        if version > SCHEMA_VERSION:
            raise InputError(f"call log schema v{version} was written by a newer draco (this one "
                             f"reads up to v{SCHEMA_VERSION}): upgrade draco", file=str(path))
    except BaseException:
        conn.close()
        raise


def _connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    _check_file(path)
    conn = (reader(path) if readonly
            else sqlite3.connect(path, check_same_thread=False, timeout=30.0))
    _check_schema(conn, path)
    if not readonly:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(SCHEMA)
            # v2 -> 3: one nullable column (rows from before name no endpoint)
            if "endpoint" not in {r[1] for r in conn.execute("PRAGMA table_info(calls)")}:
                conn.execute("ALTER TABLE calls ADD COLUMN endpoint TEXT")
            # v1 (unstamped) -> 2: the same tables; stamping the version is the migration.
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.OperationalError as exc:
            conn.close()
            raise _write_failed(path, exc) from None
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise _unreadable(path, exc) from None
    return conn


class CallLog:
    """Append-only call log with a batching writer thread; use as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = _connect(self.path)
        # Rows wait in a deque the writer drains every FLUSH_SECONDS (why not a queue:
        # docs/decisions.md). ``_wake`` hurries it: a flush, a close, or FLUSH_ROWS rows waiting.
        self._rows: collections.deque[tuple[Any, ...]] = collections.deque()
        self._flushes: collections.deque[threading.Event] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._views: list[AnsweredCalls] = []
        self._thread = threading.Thread(target=self._writer, name="draco-calllog", daemon=True)
        self._thread.start()

    # -- writing ---------------------------------------------------------------------------

    def record(self, **row: Any) -> None:
        """Queue one row (see ``COLUMNS``); it is committed within ``FLUSH_SECONDS``."""
        if self._error:
            raise self._error
        row.setdefault("created_at", _now())
        self._rows.append(tuple([row.get(c) for c in COLUMNS]))
        if len(self._rows) >= FLUSH_ROWS:
            self._wake.set()

    def record_batch(self, batch_id: str, provider: str, model: str, phase: str,
                     request_map: dict[str, Any]) -> None:
        self.flush()
        try:
            with self._conn:
                self._conn.execute(
                    "INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?, 'submitted', ?, ?)",
                    (batch_id, provider, model, phase, json.dumps(request_map), _now()))
        except sqlite3.OperationalError as exc:
            raise _write_failed(self.path, exc) from None

    def finish_batch(self, batch_id: str) -> None:
        self.flush()
        try:
            with self._conn:
                self._conn.execute("UPDATE batches SET status = 'done' WHERE batch_id = ?",
                                   (batch_id,))
        except sqlite3.OperationalError as exc:
            raise _write_failed(self.path, exc) from None

    def pending_batches(self, provider: str, model: str,
                        phase: str) -> list[tuple[str, dict[str, Any]]]:
        rows = self._conn.execute(
            "SELECT batch_id, request_map FROM batches WHERE status = 'submitted' AND "
            "provider = ? AND model = ? AND phase = ?", (provider, model, phase)).fetchall()
        return [(b, json.loads(m)) for b, m in rows]

    def _writer(self) -> None:
        sql = f"INSERT INTO calls ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
        while True:
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()
            stop = self._stop
            # flushes asked before the rows are taken: every row they wait for is committed
            waiters = [self._flushes.popleft() for _ in range(len(self._flushes))]
            pending = [self._rows.popleft() for _ in range(len(self._rows))]
            if pending:
                try:
                    with self._conn:
                        self._conn.executemany(sql, pending)
                except BaseException as exc:  # surfaced to the next record()/flush()
                    self._error = _write_failed(self.path, exc)
            for w in waiters:
                w.set()
            if stop:
                return

    def flush(self) -> None:
        """Block until every queued row is committed."""
        if self._thread.is_alive():
            done = threading.Event()
            self._flushes.append(done)
            self._wake.set()
            done.wait()
        if self._error:
            raise self._error

    def close(self) -> None:
        for view in self._views:
            view.close()
        if self._thread.is_alive():
            self._stop = True
            self._wake.set()
            self._thread.join()
        self._conn.close()
        if self._error:
            raise self._error

    def __enter__(self) -> CallLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------

    def answered(self) -> AnsweredCalls:
        """Every answered (request_hash, sample) in the log as it is now — the cache, looked up
        in the log on demand (memory does not grow with the log; rows written later are not
        in it, as they were not in the dict this once was)."""
        self.flush()
        view = AnsweredCalls(self.path, "request_hash")
        self._views.append(view)
        return view


class AnsweredCalls:
    """The answered calls of a log up to the moment it was opened, keyed (hash, sample) where
    the hash is ``request_hash`` (the cache) or ``content_hash`` (replay/): one indexed query a
    lookup; the answer text stays in the log until it is asked for. A hash that occurs twice
    answers with its last row."""

    def __init__(self, path: Path, by: str) -> None:
        if by not in ("request_hash", "content_hash"):   # a column name put into SQL
            raise ValueError(by)
        self.path, self.by = path, by
        self._conn: sqlite3.Connection | None = _connect(path, readonly=True)
        self._lock = threading.Lock()
        conn = self._conn

        def read() -> int:
            return int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM calls").fetchone()[0])

        try:
            self._last = retry_read(path, read)
        except BaseException:
            self.close()
            raise
        self._sql = (f"SELECT answer_text, parsed FROM calls WHERE {by} = ? AND "
                     "sample = ? AND status = 'ok' AND id <= ? ORDER BY id DESC LIMIT 1")

    def get(self, key: tuple[str, int], default: Any = None) -> Any:
        h, sample = key
        if not isinstance(h, str) or not self._last:
            return default
        with self._lock:
            if self._conn is None:
                raise ValueError(f"{self.path}: the call log is closed")
            row = self._conn.execute(self._sql, (h, sample, self._last)).fetchone()
        return default if row is None else Recorded(*row)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __del__(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()

