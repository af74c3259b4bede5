"""The call log shared between processes: another process opening and closing it (a second
scorer, ``draco audit cost``, a sqlite3 shell) leaves this process's later answers in it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draco_cli.llm import CallLog
from tests.llm_server import FakeLLMServer
from tests.test_llm import client, req


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer().start()
    yield s
    s.stop()


def test_another_process_closing_the_log_leaves_this_ones_later_answers_in_it(server,
                                                                              tmp_path):
    """Before the fix the client's cache view read the file's header with open()/close(),
    which dropped this process's SQLite locks; the other process, taking itself for the last
    connection, deleted the WAL this one went on committing into (the verl in-loop test's
    replay miss of 2026-12-01: 1 row seen here instead of 2)."""
    p = tmp_path / "calls.sqlite"

    def rows_another_process_sees() -> int:
        out = subprocess.run([sys.executable, "-c", (
            "import sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1])\n"
            "print(c.execute('SELECT count(*) FROM calls').fetchone()[0])\n"
            "c.close()\n"), str(p)], capture_output=True, text=True, check=True)
        return int(out.stdout)

    with CallLog(p) as log:
        c = client(server, log)      # its cache view: a second connection of this process
        c.run([req("a")])
        log.flush()
        assert rows_another_process_sees() == 1
        c.run([req("b")])
        log.flush()
        assert rows_another_process_sees() == 2
        assert p.with_name(p.name + "-wal").exists()   # the WAL this process writes, kept
