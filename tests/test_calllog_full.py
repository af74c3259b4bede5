"""The call log on a real full filesystem: SQLite's own "database or disk is full" comes out
as one line naming the call log, in the library and at the command line."""

from __future__ import annotations

import contextlib

import pytest

from draco_cli.errors import DracoError
from draco_cli.llm.calllog import CallLog
from tests.test_fail_loudly import tmpfs


def _fill(fs) -> None:
    with contextlib.suppress(OSError), open(fs / "filler", "wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)


def test_full_disk_while_logging_names_the_call_log():
    with tmpfs("2m") as fs:
        path = fs / "run" / "llm_calls.sqlite"
        log = CallLog(path)
        log.record(request_hash="h0", sample=0, phase="score", status="ok", answer_text="{}",
                   parsed="{}")
        log.flush()
        _fill(fs)
        with pytest.raises(DracoError) as info:
            for i in range(1, 400):  # pages of the log and its WAL need room the disk lacks
                log.record(request_hash=f"h{i}", sample=0, phase="score", status="ok",
                           answer_text="x" * 4000, parsed="{}")
            log.flush()
        message = str(info.value)
        assert message.startswith(f"{path}: cannot write the call log: database or disk is "
                                  "full"), message
        assert "\n" not in message
        with contextlib.suppress(DracoError):
            log.close()
        (fs / "filler").unlink()
        # what was committed before the disk filled is still there
        with CallLog(path) as again:
            assert again.answered().get(("h0", 0)) is not None


def test_full_disk_when_opening_a_new_call_log():
    with tmpfs("2m") as fs:
        _fill(fs)
        path = fs / "llm_calls.sqlite"
        with pytest.raises(DracoError) as info:
            CallLog(path)
        assert str(info.value).startswith(f"{path}: cannot write the call log: "), info.value
        assert "corrupt" not in str(info.value)
