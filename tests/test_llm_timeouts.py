"""A call draco abandons at its timeout is cancelled at the server: the connection is closed
(vLLM's ``with_cancellation`` aborts the request on that disconnect), the call log records the
timeout, and no slot stays held for the abandoned call (issue 33).

The server here is aiohttp's own, started by the test with ``handler_cancellation=True`` so a
handler is cancelled when its client disconnects, as vLLM's route is; it records when each
request arrived and when it was cancelled."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from typing import Any

import pytest
from aiohttp import web
from pydantic import BaseModel

from draco_cli.llm import CallLog, LLMClient, LLMError, LLMRequest


class Verdict(BaseModel):
    verdict: str


class SlowServer:
    """``mode``: "silent" never sends a byte; "trickle" sends headers, then a space every
    0.2 s (a read timeout alone never fires); "answer" replies at once; "once" is silent
    for the first request and answers the others."""

    def __init__(self) -> None:
        self.mode = "silent"
        self.started: list[float] = []
        self.cancelled: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.started.append(time.monotonic())
        try:
            if self.mode == "answer" or (self.mode == "once" and len(self.started) > 1):
                return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"content": '{"verdict": "pass"}'}}],
                                          "usage": {"prompt_tokens": 5,
                                                    "completion_tokens": 3}})
            if self.mode == "trickle":
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                await resp.prepare(request)
                for _ in range(600):
                    await resp.write(b" ")
                    await asyncio.sleep(0.2)
                return resp
            await asyncio.sleep(120)
            raise AssertionError("the client never gave up")
        except asyncio.CancelledError:
            self.cancelled.append(time.monotonic())
            raise

    def start(self) -> SlowServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self.chat)
            self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = int(self._runner.addresses[0][1])
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        threading.Thread(target=run, daemon=True).start()
        assert ready.wait(10)
        return self

    def stop(self) -> None:
        assert self._loop is not None and self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def slow():
    s = SlowServer().start()
    yield s
    s.stop()


def _req(key: str) -> LLMRequest:
    return LLMRequest(phase="score", key=key, answer_model=Verdict,
                      messages=[{"role": "user", "content": f"judge {key}"}])


def _wait_for(cond: Any, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_timed_out_call_is_cancelled_at_the_server_and_logged(slow, tmp_path, mode):
    slow.mode = mode
    timeout = 1.0
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = LLMClient("openai/slow", call_log=log, base_url=f"http://127.0.0.1:{slow.port}/v1",
                      timeout=timeout, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(LLMError, match=r"giving up after 1 attempts \(timeout"):
            c.run([_req("r1")])
        gave_up = time.monotonic() - t0
    assert timeout <= gave_up
    _wait_for(lambda: len(slow.cancelled) == 1)
    # the server saw the connection closed, so its handler was cancelled, within about a
    # second of draco's timeout
    assert len(slow.started) == 1 and len(slow.cancelled) == 1
    assert slow.cancelled[0] - slow.started[0] < timeout + 1.0
    rows = sqlite3.connect(tmp_path / "calls.sqlite").execute(
        "SELECT status, error FROM calls ORDER BY id").fetchall()
    assert rows[0][0] == "http_error" and "timeout" in rows[0][1]


def test_the_retry_of_a_timed_out_call_goes_out_at_once(slow, tmp_path):
    """One slot (a serial server's limit): the abandoned call was aborted at the server, so
    its retry is sent at once, not after a ghost of it held the slot for another timeout."""
    slow.mode, timeout = "once", 2.0
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = LLMClient("openai/slow", call_log=log, base_url=f"http://127.0.0.1:{slow.port}/v1",
                      timeout=timeout, max_retries=1, backoff_base=0.01, concurrency=1)
        [[answer]] = c.run([_req("r1")])
    assert answer.status == "ok"
    assert len(slow.started) == 2
    assert slow.started[1] - slow.cancelled[0] < 1.0   # no slot held for the abandoned call
