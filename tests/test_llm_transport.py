"""The two ways a single call reaches an OpenAI-compatible server: draco's own aiohttp session
("aiohttp", the default) and the openai SDK's ``post`` ("sdk": a key that is not static, or a
proxy from the environment; here chosen by making ``direct_headers`` say so).
Every fault the local server can inject is run through both, each against a fresh server:
what the user sees (the answer or the one-line error) and what the call log holds must be the
same, and each must be what the client promises (retried or not, the server's reason kept,
keys redacted)."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import time
from typing import Any

import pytest

import draco_cli.llm.providers.openai as openai_provider
from draco_cli.errors import UsageError
from draco_cli.llm import CallLog, LLMClient, LLMError
from draco_cli.llm.providers import make_provider
from tests.llm_server import FakeLLMServer
from tests.test_llm import PLANTED, PRICES, req

TRANSPORTS = ("aiohttp", "sdk")
_DIRECT_HEADERS = openai_provider.direct_headers


def _route(transport: str, monkeypatch) -> None:
    """The SDK's route, as a client whose key is not static takes it; else draco's own."""
    monkeypatch.setattr(openai_provider, "direct_headers", _DIRECT_HEADERS
                        if transport == "aiohttp" else lambda client, timeout: None)


def _run(transport: str, tmp_path, monkeypatch, faults: list[tuple[str, dict[str, Any]]],
         **kw: Any) -> dict[str, Any]:
    """One request through ``transport`` against a fresh server holding ``faults``: what the
    caller got, the call-log rows, the HTTP requests the server saw and the time taken."""
    _route(transport, monkeypatch)
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    server = FakeLLMServer().start()
    try:
        for kind, opts in faults:
            server.push(kind, **opts)
        kw.setdefault("backoff_base", 0.01)
        path = tmp_path / f"{transport}.sqlite"
        t0 = time.perf_counter()
        with CallLog(path) as log:
            client = LLMClient("openai/test-model", call_log=log, base_url=server.url + "/v1",
                               prices=PRICES, **kw)
            try:
                [answers] = client.run([req("a")])
                got: Any = [(a.status, a.reason, a.value and a.value.model_dump())
                             for a in answers]
            except LLMError as exc:
                got = (type(exc).__name__, str(exc))
        elapsed = time.perf_counter() - t0
        conn = sqlite3.connect(path)
        rows = conn.execute("SELECT status, error, response FROM calls ORDER BY id").fetchall()
        conn.close()
        # each run has its own server: its URL is named alike in both
        named = json.loads(json.dumps([got, rows]).replace(server.url, "http://SERVER"))
        return {"got": named[0],   # a list of answers, or [error type, message]
                "rows": [tuple(r) for r in named[1]], "hits": server.hits["chat"],
                "elapsed": elapsed, "headers": server.headers}
    finally:
        server.stop()


def _comparable(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    # an answered row's response holds the server's random completion id; errors are exact
    return [(s, e, r if s == "http_error" else None) for s, e, r in rows]


def _both(tmp_path, monkeypatch, faults, **kw) -> dict[str, Any]:
    """Both routes' runs of ``faults``; draco's must match the SDK's (returns draco's)."""
    sdk = _run("sdk", tmp_path, monkeypatch, faults, **kw)
    out = _run("aiohttp", tmp_path, monkeypatch, faults, **kw)
    assert out["got"] == sdk["got"]
    assert _comparable(out["rows"]) == _comparable(sdk["rows"])
    assert out["hits"] == sdk["hits"]
    return out


def _error_json(message: str, kind: str = "invalid_request_error") -> str:
    return json.dumps({"error": {"message": message, "type": kind, "code": None}})


def _raw(status: int, body: str, **kw: Any) -> tuple[str, dict[str, Any]]:
    return ("raw", {"status": status, "body": body, **kw})


@pytest.mark.parametrize("faults,errors", [
    ([("429", {"retry_after": 0.05}), ("500", {}), ("529", {})],
     ["HTTP 429: injected 429 #1", "HTTP 500: injected 500 #2", "HTTP 529: injected 529 #3"]),
    ([_raw(408, _error_json("request timeout")), _raw(409, _error_json("conflict"))],
     ["HTTP 408", "HTTP 409"]),
    ([("drop", {})], ["connection dropped by the server"]),
    ([_raw(502, "<html>bad gateway</html>", content_type="text/html")],
     ["HTTP 502: Error code: 502"]),
    ([_raw(200, "{not json", content_type="text/plain"), _raw(200, "[1, 2]")],
     ["the server sent a body that is not JSON",
      "the server sent JSON that is not a chat completion object"]),
])
def test_retried_failures_are_logged_alike_then_answered(tmp_path, monkeypatch, faults, errors):
    out = _both(tmp_path, monkeypatch, faults)
    assert [g[0] for g in out["got"]] == ["ok"]
    assert [r[1] for r in out["rows"] if r[0] == "http_error"] == errors
    assert out["hits"] == len(faults) + 1


@pytest.mark.parametrize("status,body,says", [
    (400, _error_json("This model's maximum context length is 2048 tokens; you asked 9000",
                      "context_length_exceeded"),
     "HTTP 400: This model's maximum context length is 2048 tokens"),
    (401, _error_json(f"Incorrect API key provided: {PLANTED}"), "HTTP 401: Incorrect API key"),
    (403, _error_json("Project does not have access to model test-model"), "HTTP 403: Project"),
    (404, _error_json("The model `test-model` does not exist"), "HTTP 404: The model"),
    (422, "unprocessable", "HTTP 422: Error code: 422"),
])
def test_rejected_requests_stop_alike_with_the_servers_reason(tmp_path, monkeypatch, status,
                                                              body, says):
    out = _both(tmp_path, monkeypatch, [_raw(status, body)])
    kind, message = out["got"]
    assert kind == "RequestRejected" and message.startswith(f"openai/test-model: {says}")
    assert out["hits"] == 1   # not retried: every attempt would be rejected alike
    assert PLANTED not in message and PLANTED not in json.dumps(out["rows"])
    [(status_, error, response)] = out["rows"]
    assert status_ == "http_error" and error == message


def test_retry_after_is_honoured_by_both(tmp_path, monkeypatch):
    for transport in TRANSPORTS:
        out = _run(transport, tmp_path, monkeypatch,
                   [_raw(429, _error_json("slow down", "rate_limit"),
                         headers={"retry-after": "0.4"})])
        assert [g[0] for g in out["got"]] == ["ok"] and out["elapsed"] >= 0.4, transport


def test_a_timeout_is_a_timeout_in_both(tmp_path, monkeypatch):
    out = _both(tmp_path, monkeypatch, [("slow", {"seconds": 1.5})], timeout=0.3)
    assert [g[0] for g in out["got"]] == ["ok"]
    assert [r[1] for r in out["rows"]][:1] == ["timeout (no reply within --timeout)"]


def test_giving_up_reads_the_same(tmp_path, monkeypatch):
    out = _both(tmp_path, monkeypatch, [("500", {})] * 3, max_retries=2)
    assert out["got"] == ["LLMError", "openai/test-model at http://SERVER/v1: giving up after "
                          "3 attempts (HTTP 500: injected 500 #3)"]


def test_no_choices_is_unanswered_in_both(tmp_path, monkeypatch):
    out = _both(tmp_path, monkeypatch, [_raw(200, json.dumps({"object": "chat.completion"}))])
    assert out["got"] == [["unanswered", "the server returned no choice", None]]


def test_connection_refused_reads_the_same(tmp_path, monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    said = {}
    for transport in TRANSPORTS:
        _route(transport, monkeypatch)
        with CallLog(tmp_path / f"{transport}.sqlite") as log:
            c = LLMClient("openai/m", call_log=log, base_url=f"http://127.0.0.1:{port}/v1",
                          backoff_base=0.01)
            with pytest.raises(LLMError) as err:
                c.run([req("a")])
        said[transport] = str(err.value)
    assert said["sdk"] == said["aiohttp"]
    assert "connection refused (is the server running?)" in said["aiohttp"]
    assert "after 3 attempts" in said["aiohttp"]


def test_the_direct_path_sends_what_the_sdk_sends(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_ORG_ID", "org-test")
    sent = {t: _run(t, tmp_path, monkeypatch, [])["headers"][0] for t in TRANSPORTS}
    lower = {t: {k.lower(): v for k, v in h.items()} for t, h in sent.items()}
    for name in ("authorization", "content-type", "accept", "user-agent", "openai-organization",
                 "x-stainless-lang", "x-stainless-package-version", "x-stainless-async",
                 "x-stainless-retry-count", "x-stainless-read-timeout", "content-length"):
        assert lower["aiohttp"].get(name) == lower["sdk"].get(name), name
    # what the transport adds itself (each run has its own server: the port differs)
    assert lower["aiohttp"]["host"].rsplit(":", 1)[0] == "127.0.0.1"
    assert lower["aiohttp"]["authorization"] == f"Bearer {PLANTED}"
    assert lower["aiohttp"]["openai-organization"] == "org-test"


def test_the_route_is_chosen(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)

    def direct(url: str = "http://127.0.0.1:9/v1") -> bool:
        p = make_provider("openai/m", base_url=url)
        try:
            return p.direct is not None  # type: ignore[attr-defined]
        finally:
            asyncio.run(p.close())

    assert direct() and direct("https://127.0.0.1:9/v1")   # the default
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert not direct()                  # a proxy from the environment: the SDK's route
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert direct()


def test_a_key_http_cannot_carry_is_refused_without_showing_it(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED + "\n")
    with pytest.raises(UsageError, match="holds a character HTTP does not allow") as err:
        make_provider("openai/m", base_url="http://127.0.0.1:9/v1")
    assert PLANTED not in str(err.value)


def test_the_json_sent_is_the_body_built(monkeypatch):
    """The JSON sent (the messages spliced in from the JSON their cache key hashed) is the body
    each request builds, numbers equal as values but encoded apart kept apart."""
    from draco_cli.llm.types import Sampling

    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    p = make_provider("openai/m", base_url="http://127.0.0.1:9/v1")
    cases = [Sampling(), Sampling(temperature=1), Sampling(temperature=1.0),
             Sampling(temperature=0.0), Sampling(temperature=-0.0), Sampling(seed=3),
             Sampling(thinking=True), Sampling(max_tokens=7)]
    for round_ in range(2):
        for k, sampling in enumerate(cases):
            for n in (1, 3):
                for name in ("answer", "other"):
                    r = req(f"k{k}", sampling=sampling, schema_name=name)
                    wire, text = p.wire(r, r.messages, n)  # type: ignore[attr-defined]
                    assert json.loads(text) == wire
                    if sampling.temperature is not None:
                        assert f'"temperature":{sampling.temperature!r}' in text
    asyncio.run(p.close())
