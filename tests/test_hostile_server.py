"""A server that tries to hang or exhaust the client (issue 31): a Retry-After of days or
``inf``, a reply body with no end, a small gzip reply inflating to hundreds of MiB, token
counts that are negative, fractional or absurd. Each is served by a local aiohttp server the
test starts; the client must end the call (unanswered with the reason) in seconds, with its
memory bounded, and never count a negative or impossible cost — on each route a call can take
(issue 31, issue 33): draco's own aiohttp route, the openai SDK's (httpx, as for a proxy or a
key that is not static) and the anthropic SDK's, the SDKs' real code over their own
transports."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
import tracemalloc
import zlib
from typing import Any

import pytest
from aiohttp import web

from draco_cli.errors import UsageError
from draco_cli.llm import CallLog, LLMClient, LLMError
from draco_cli.llm.prices import PriceTable
from draco_cli.llm.settings import LLMSettings
from tests.llm_server import FakeLLMServer, schema_answer
from tests.test_llm import PLANTED, PRICES, req

MiB = 2**20
ANSWER = json.dumps({"verdict": "pass", "steps": [1], "reason": "ok"})


def _completion(usage: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion", "model": "test-model",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": ANSWER}}],
            "usage": usage}


# the OpenAI usage fields the cases below name, as Anthropic's Messages API names them
_ANTHROPIC_USAGE = {"prompt_tokens": "input_tokens", "completion_tokens": "output_tokens"}


def _message(usage: Any) -> dict[str, Any]:
    if isinstance(usage, dict):
        usage = {_ANTHROPIC_USAGE.get(k, k): v for k, v in usage.items()}
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "test-claude",
            "content": [{"type": "text", "text": ANSWER}], "stop_reason": "end_turn",
            "usage": usage}


class Hostile:
    """One aiohttp server in a thread; ``behave`` picks what /v1/chat/completions does."""

    def __init__(self) -> None:
        self.behave = "ok"
        self.retry_after = "1000000"
        self.usage: Any = {"prompt_tokens": 10, "completion_tokens": 5}
        self.body_mib = 512
        self.bomb = b""
        self.hits = 0
        self.sent = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.hits += 1
        if self.behave == "declared":   # a Content-Length of 1 GiB, of which 1 MiB is sent
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 1 << 30
            await resp.prepare(request)
            try:
                await resp.write(b" " * MiB)
                self.sent += MiB
            except (ConnectionError, RuntimeError):
                pass
            return resp
        if self.behave == "retry-after":
            return web.json_response({"error": {"message": "slow down"}}, status=429,
                                     headers={"Retry-After": self.retry_after})
        if self.behave == "endless":   # chunked, no Content-Length, up to body_mib MiB
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            chunk = b" " * MiB
            try:
                for _ in range(self.body_mib):
                    await resp.write(chunk)
                    self.sent += len(chunk)
            except (ConnectionError, RuntimeError):
                pass   # the client stopped reading: what it should do
            return resp
        if self.behave == "bomb":
            return web.Response(body=self.bomb, headers={
                "Content-Type": "application/json", "Content-Encoding": "gzip"})
        if self.behave == "gzip":   # an honest compressed reply
            z = zlib.compressobj(6, zlib.DEFLATED, 31)
            body = json.dumps(_completion(self.usage) if request.path.endswith("completions")
                              else _message(self.usage)).encode()
            return web.Response(body=z.compress(body) + z.flush(), headers={
                "Content-Type": "application/json", "Content-Encoding": "gzip"})
        if request.path.endswith("/messages"):
            return web.json_response(_message(self.usage))
        return web.json_response(_completion(self.usage))

    def __enter__(self) -> Hostile:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/messages", self.chat)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        self.root = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self.url = self.root + "/v1"
        self._loop, self._runner = loop, runner
        self._thread = threading.Thread(target=loop.run_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def hostile(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    with Hostile() as server:
        yield server


ROUTES = ["aiohttp", "openai-sdk", "anthropic-sdk"]


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    """Which route the calls take. openai-sdk: the openai provider's SDK path, which it takes
    for a key that is not static or a proxy from the environment (``direct_headers`` None,
    as it returns then); every call through it is counted, so the test knows it was taken."""
    import draco_cli.llm.providers.anthropic  # noqa: F401 - imported before a test times
    import draco_cli.llm.providers.openai as openai_provider

    taken = {"sdk": 0}
    if request.param == "openai-sdk":
        real = openai_provider.post_json

        async def counted(*a: Any, **k: Any) -> Any:
            taken["sdk"] += 1
            return await real(*a, **k)

        monkeypatch.setattr(openai_provider, "direct_headers", lambda client, timeout: None)
        monkeypatch.setattr(openai_provider, "post_json", counted)
    yield request.param
    if request.param == "openai-sdk":
        assert taken["sdk"] > 0, "the calls did not go through the SDK"


def _ask(server: Hostile, tmp_path, route: str = "aiohttp", **kw: Any
         ) -> tuple[Any, list[tuple[Any, ...]], float, LLMClient]:
    kw.setdefault("backoff_base", 0.01)
    t0 = time.perf_counter()
    anthropic = route == "anthropic-sdk"
    with CallLog(tmp_path / "calls.sqlite") as log:
        client = LLMClient("anthropic/test-claude" if anthropic else "openai/test-model",
                           call_log=log, base_url=server.root if anthropic else server.url,
                           prices=PRICES, **kw)
        try:
            [answers] = client.run([req("a")])
            got: Any = [(a.status, a.reason, a.cost_usd) for a in answers]
        except LLMError as exc:
            got = str(exc)
    elapsed = time.perf_counter() - t0
    conn = sqlite3.connect(tmp_path / "calls.sqlite")
    rows = conn.execute("SELECT status, error, cost_usd FROM calls ORDER BY id").fetchall()
    conn.close()
    return got, rows, elapsed, client


@pytest.mark.parametrize("value", ["1000000", "inf", "1e308"])
def test_a_retry_after_of_days_is_waited_no_longer_than_the_timeout(hostile, tmp_path, value,
                                                                     route):
    hostile.behave, hostile.retry_after = "retry-after", value
    got, rows, elapsed, _ = _ask(hostile, tmp_path, route, timeout=0.5, max_retries=1)
    # two attempts, one wait of at most --timeout: seconds, not days
    assert hostile.hits == 2 and elapsed < 5, (elapsed, hostile.hits)
    assert "giving up after 2 attempts" in got and "HTTP 429" in got


def test_a_retry_after_within_the_timeout_is_still_honoured(hostile, tmp_path, route):
    hostile.behave, hostile.retry_after = "retry-after", "0.6"
    _, _, elapsed, _ = _ask(hostile, tmp_path, route, timeout=30.0, max_retries=1)
    assert hostile.hits == 2 and elapsed >= 0.6


def _peak_mib(call) -> tuple[Any, float]:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = call()
        return out, tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()


def test_an_endless_chunked_body_is_given_up_on_at_the_bound(hostile, tmp_path, route):
    hostile.behave, hostile.body_mib = "endless", 512
    (got, rows, elapsed, _), peak = _peak_mib(
        lambda: _ask(hostile, tmp_path, route, timeout=60.0, max_reply_bytes=4 * MiB))
    [(status, reason, cost)] = got
    assert status == "unanswered" and "--max-reply-mib 4 MiB" in reason and cost == 0.0
    assert hostile.hits == 1            # not retried: another try would read as much again
    assert hostile.sent < 128 * MiB     # the client stopped reading long before the end
    assert peak < 48, f"peak Python memory {peak:.1f} MiB for a 4 MiB bound"
    assert [r[0] for r in rows] == ["http_error", "unanswered"]


def test_a_gzip_bomb_is_given_up_on_at_the_bound(hostile, tmp_path, route):
    z = zlib.compressobj(9, zlib.DEFLATED, 31)   # gzip
    zeros = b"\0" * MiB
    hostile.bomb = b"".join([z.compress(zeros) for _ in range(256)] + [z.flush()])
    assert len(hostile.bomb) < MiB          # < 1 MiB on the wire, 256 MiB inflated
    hostile.behave = "bomb"
    (got, _, _, _), peak = _peak_mib(
        lambda: _ask(hostile, tmp_path, route, timeout=60.0, max_reply_bytes=4 * MiB))
    [(status, reason, cost)] = got
    assert status == "unanswered" and "decompressed" in reason and cost == 0.0
    assert hostile.hits == 1
    assert peak < 48, f"peak Python memory {peak:.1f} MiB inflating a 256 MiB gzip bomb"


@pytest.mark.parametrize("behave", ["ok", "gzip"])
def test_the_default_bound_takes_an_ordinary_reply(hostile, tmp_path, route, behave):
    hostile.behave = behave
    got, _, _, client = _ask(hostile, tmp_path, route)
    assert got[0][0] == "ok" and got[0][2] > 0 and client.spent == got[0][2], got


def test_a_declared_length_over_the_bound_is_refused_before_reading(hostile, tmp_path, route):
    hostile.behave = "declared"
    got, rows, elapsed, _ = _ask(hostile, tmp_path, route, timeout=60.0,
                                 max_reply_bytes=4 * MiB)
    [(status, reason, cost)] = got
    assert status == "unanswered" and "Content-Length is 1,073,741,824 bytes" in reason, reason
    assert "--max-reply-mib 4 MiB" in reason and cost == 0.0 and hostile.hits == 1
    assert elapsed < 30


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": -50_000_000, "completion_tokens": 5},
    {"prompt_tokens": 10, "completion_tokens": -1},
    {"prompt_tokens": 10, "completion_tokens": 10**15},
    {"prompt_tokens": 10, "completion_tokens": 2.5},
    {"prompt_tokens": "many", "completion_tokens": 5},
    {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 11}},
    {"prompt_tokens": 10, "completion_tokens": 5, "completion_tokens_details": [1]},
    "lots",
])
def test_impossible_token_counts_are_refused_and_cost_nothing(hostile, tmp_path, usage, route):
    if route == "anthropic-sdk" and isinstance(usage, dict) and any(
            k.endswith("_details") for k in usage):
        pytest.skip("OpenAI's detail fields: Anthropic's messages have none")
    hostile.usage = usage
    got, rows, _, client = _ask(hostile, tmp_path, route, max_cost=1.0)
    [(status, reason, cost)] = got
    assert status == "unanswered" and "reply not used" in reason, reason
    assert cost == 0.0 and client.spent == 0.0
    assert all(r[2] is None or r[2] >= 0 for r in rows), rows
    assert hostile.hits == 1


def test_negative_usage_never_lowers_the_budget(hostile, tmp_path):
    """Without the check, one reply of -50M prompt tokens would be -$50 and let a $0.0001
    budget pay for everything after it; here every call costs what it is, and stops."""
    hostile.usage = {"prompt_tokens": -50_000_000, "completion_tokens": 5}
    with CallLog(tmp_path / "calls.sqlite") as log:
        client = LLMClient("openai/test-model", call_log=log, base_url=hostile.url,
                           prices=PRICES, max_cost=1e-4, concurrency=1, backoff_base=0.01)
        client.run([req("a")])
        assert client.spent == 0.0
        hostile.usage = {"prompt_tokens": 100, "completion_tokens": 5}
        answers = client.run([req(f"b{i}") for i in range(5)])
    statuses = [a.status for [a] in answers]
    assert statuses.count("ok") == 1 and statuses.count("skipped") == 4, statuses
    conn = sqlite3.connect(tmp_path / "calls.sqlite")
    assert conn.execute("SELECT MIN(cost_usd) FROM calls").fetchone()[0] >= 0
    conn.close()


def test_a_negative_price_is_refused():
    with pytest.raises(Exception, match="negative"):
        PriceTable({"models": {"openai/x": {"input": -1.0, "output": 1.0}}}, "prices.json")


@pytest.mark.parametrize("mib", [0, -1, float("inf"), float("nan")])
def test_the_bound_must_be_a_positive_size(mib):
    with pytest.raises(UsageError, match="--max-reply-mib"):
        LLMSettings(model="mock/x", max_reply_mib=mib)


class _QuietingSerialServer(FakeLLMServer):
    """One request at a time (llama-cpp-python's server) on a machine that gets less busy:
    the first calls are slow, so a later round's rate looks like a gain from parallelism."""

    @property
    def latency(self) -> float:
        return 0.6 if self.hits["chat"] <= 2 else 0.15

    @latency.setter
    def latency(self, value: float) -> None:
        pass


def test_llm_check_sees_a_queue_that_a_busy_machine_hides(monkeypatch):
    from draco_cli.llm.checks import _check_parallelism
    from draco_cli.llm.providers import make_provider

    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    server = _QuietingSerialServer(answer=schema_answer)
    server.serial = True
    server.start()
    findings: list[Any] = []
    advice: dict[str, str] = {}

    async def probe() -> None:
        provider = make_provider("openai/test-model", base_url=server.url + "/v1")
        try:
            await _check_parallelism(provider, 64, 0.0, None, findings, advice)
        finally:
            await provider.close()

    try:
        asyncio.run(probe())
    finally:
        server.stop()
    # the warm-up and 1 at once take 0.6 s, then 2 at once end at 0.15 and 0.3 s: the rate
    # alone (1.7 against 6.7 calls/s) would advise 2
    assert server.hits["chat"] == 4
    assert advice["--concurrency"] == "1", findings
    assert findings[-1].detail.endswith("; 2 sent at once came back one after another (queued)")


@pytest.mark.parametrize("model", ["openai/test-model", "anthropic/test-claude"])
def test_a_batch_result_file_is_not_held_to_the_per_reply_bound(monkeypatch, tmp_path, model):
    """The result file holds every line's reply, so it passes the bound a reply is held to;
    each reply within it is under it, and the batch is answered whole."""
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    server = FakeLLMServer(answer=schema_answer, batch_polls=1).start()
    try:
        with CallLog(tmp_path / "calls.sqlite") as log:
            client = LLMClient(model, call_log=log, prices=PRICES, backoff_base=0.01,
                               base_url=server.url + ("/v1" if model.startswith("openai/")
                                                      else ""),
                               max_reply_bytes=4096)
            answers = client.run([req(f"r{i}") for i in range(40)], batch=True,
                                 poll_seconds=0.01)
    finally:
        server.stop()
    assert [a.status for [a] in answers] == ["ok"] * 40
    conn = sqlite3.connect(tmp_path / "calls.sqlite")
    sizes = conn.execute("SELECT length(response), batch_id IS NOT NULL FROM calls").fetchall()
    conn.close()
    assert all(batched for _, batched in sizes)
    assert sum(n for n, _ in sizes) > 4096 > max(n for n, _ in sizes)   # file over, lines under
