"""draco's own HTTP/1.1 client (``llm/http1.py``), the default route for ``http://`` servers.

Against local servers the tests start: a raw TCP server answering scripted bytes (framings,
encodings, broken replies, dropped and silent connections) and the project's protocol server
through ``LLMClient``. The parser is also fed every reply in random fragments: the bytes
arriving in any pieces must give the same reply."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.llm.http1 import (
    Http1Pool,
    MalformedReply,
    ServerDisconnected,
    TruncatedReply,
    _Connection,
)

Script = Callable[[int, bytes], list[bytes] | None]
CLOSE = b"<close the connection here>"
RESET = b"<reset the connection here>"


class RawServer:
    """Accepts connections; for the n-th request (0-based, over all connections) sends what
    ``script(n, request)`` returns, piece by piece (``None``: close without a word; b"" in the
    list: a 50 ms pause; ``CLOSE``: close the connection there; ``RESET``: reset it). Records every request's bytes and each connection it came on."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.connection_of: list[int] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                n = len(self.requests)
                self.requests.append(request)
                self.connection_of.append(conn)
                pieces = self.script(n, request)
                if pieces is None or CLOSE in pieces[:1]:
                    break
                for piece in pieces:
                    if piece is CLOSE:
                        return
                    if piece is RESET:   # an RST, not a FIN: linger 0, then close
                        import socket
                        import struct

                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        return
                    if piece:
                        writer.write(piece)
                        await writer.drain()
                    else:
                        await asyncio.sleep(0.05)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes = b'{"ok": 1}', *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(body: bytes, sizes: tuple[int, ...] = (3, 5), trailer: str = "") -> bytes:
    out, i, k = [], 0, 0
    while i < len(body):
        size = sizes[k % len(sizes)]
        piece = body[i:i + size]
        out.append(f"{len(piece):x};ext=1\r\n".encode() + piece + b"\r\n")
        i += size
        k += 1
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(out)
            + b"0\r\n" + trailer.encode() + b"\r\n")


def pool(port: int, **kw: Any) -> Http1Pool:
    opts: dict[str, Any] = {"limit": 4, "keepalive_expiry": 5.0, "connect_timeout": 2.0,
                            "read_timeout": 2.0, **kw}
    return Http1Pool("127.0.0.1", port, {"Authorization": "Bearer k",
                                          "Content-Type": "application/json"}, **opts)


def exchange(script: Script, bodies: list[bytes], **kw: Any) -> tuple[list[Any], RawServer]:
    """POST each body in turn on one pool; the replies (or the exception each raised)."""
    async def go() -> tuple[list[Any], RawServer]:
        async with RawServer(script) as server:
            p = pool(server.port, **kw)
            out: list[Any] = []
            for body in bodies:
                try:
                    out.append(await p.post("/v1/chat/completions", body))
                except Exception as exc:  # noqa: BLE001 - the test compares what was raised
                    out.append(exc)
            await p.close()
            return out, server
    return asyncio.run(go())


def test_the_request_is_sent_as_one_well_formed_message() -> None:
    [reply], server = exchange(lambda n, r: [ok()], [b'{"messages": []}'])
    assert reply.status == 200 and json.loads(reply.body) == {"ok": 1}
    assert server.requests == [
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"Host: 127.0.0.1:%d\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\n"
        b"Accept-Encoding: gzip, deflate\r\nContent-Length: 16\r\n\r\n"
        b'{"messages": []}' % server.port]


def test_keep_alive_connections_are_reused() -> None:
    replies, server = exchange(lambda n, r: [ok(b'{"n": %d}' % n)], [b"{}"] * 5)
    assert [json.loads(r.body)["n"] for r in replies] == [0, 1, 2, 3, 4]
    assert server.connections == 1


@pytest.mark.parametrize("reply,reused", [
    (ok(b"{}", "Connection: close"), False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}", True),
    (chunked(b"{}"), True),
])
def test_a_connection_is_reused_only_when_the_reply_allows_it(reply, reused) -> None:
    replies, server = exchange(lambda n, r: [reply], [b"{}"] * 3)
    assert [r.body for r in replies] == [b"{}"] * 3
    assert server.connections == (1 if reused else 3)


def test_a_body_may_run_to_the_end_of_the_connection() -> None:
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"a": 1}'
    replies, server = exchange(lambda n, r: [reply[:30], b"", reply[30:], b"", CLOSE],
                               [b"{}", b"{}"])
    assert [r.body for r in replies] == [b'{"a": 1}'] * 2 and server.connections == 2
    # while the connection stays open, such a body has not ended
    [open_ended], _ = exchange(lambda n, r: [reply, b"", b"", b""], [b"{}"], read_timeout=0.1)
    assert isinstance(open_ended, asyncio.TimeoutError)


def test_a_reset_inside_a_body_without_length_is_not_a_reply() -> None:
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"a": '
    [got], _ = exchange(lambda n, r: [reply, b"", RESET], [b"{}"])
    assert isinstance(got, TruncatedReply)


def test_heads_with_bare_line_feeds_are_read() -> None:
    [got], _ = exchange(lambda n, r: [b"HTTP/1.1 200 OK\nContent-Length: 2\nX-A: 1\r\n\n{}"],
                        [b"{}"])
    assert got.body == b"{}" and got.headers["x-a"] == "1"


def test_an_empty_compressed_body_is_empty() -> None:
    [got], _ = exchange(lambda n, r: [b"HTTP/1.1 400 Bad Request\r\nContent-Encoding: gzip\r\n"
                                      b"Content-Length: 0\r\n\r\n"], [b"{}"])
    assert got.status == 400 and got.body == b""


def test_a_connection_that_ends_before_its_request_is_dropped_not_a_crash() -> None:
    """A server that speaks first (or closes) right after accepting: the request is never
    written on the dead connection; the call fails as dropped, which the client retries."""
    async def go() -> BaseException | None:
        async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.close()
        server = await asyncio.start_server(greet, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        p = pool(port)
        real_connect = p._connect

        async def slow_connect(loop: asyncio.AbstractEventLoop) -> _Connection:
            conn = await real_connect(loop)
            await asyncio.sleep(0.05)   # the greeting arrives before the request goes out
            return conn
        p._connect = slow_connect  # type: ignore[method-assign]
        try:
            await p.post("/", b"{}")
        except BaseException as exc:  # noqa: BLE001
            return exc
        finally:
            await p.close()
            server.close()
        return None
    assert isinstance(asyncio.run(go()), ServerDisconnected)


def test_a_closing_idle_connection_is_not_taken() -> None:
    async def go() -> tuple[bytes, int]:
        async with RawServer(lambda n, r: [ok(b'{"n": %d}' % n)]) as server:
            p = pool(server.port)
            await p.post("/", b"{}")
            [idle] = p._idle
            assert idle.transport is not None
            idle.transport.close()   # closing; connection_lost has not run yet
            second = await p.post("/", b"{}")
            await p.close()
            return second.body, server.connections
    assert asyncio.run(go()) == (b'{"n": 1}', 2)


def test_chunked_replies_with_extensions_and_trailers() -> None:
    body = json.dumps({"choices": [{"message": {"content": "x" * 100}}]}).encode()
    [reply], _ = exchange(lambda n, r: [chunked(body, (7, 1, 30), "X-Trailer: t\r\n")],
                          [b"{}"])
    assert reply.body == body


def test_interim_replies_are_skipped() -> None:
    [reply], _ = exchange(lambda n, r: [b"HTTP/1.1 100 Continue\r\n\r\n",
                                        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n",
                                        ok()], [b"{}"])
    assert reply.status == 200 and reply.body == b'{"ok": 1}'


@pytest.mark.parametrize("encoding,encode", [
    ("gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),   # raw deflate, as some servers send it
])
def test_compressed_replies_are_decoded(encoding, encode) -> None:
    body = json.dumps({"a": "y" * 500}).encode()
    [reply], _ = exchange(lambda n, r: [ok(encode(body), f"Content-Encoding: {encoding}")],
                          [b"{}"])
    assert reply.body == body


def test_repeated_headers_are_joined_and_names_lowercased() -> None:
    [reply], _ = exchange(lambda n, r: [ok(b"{}", "X-A: 1", "x-a: 2", "Retry-After: 3")],
                          [b"{}"])
    assert reply.headers["x-a"] == "1, 2" and reply.headers["retry-after"] == "3"


@pytest.mark.parametrize("reply,says", [
    (b"HTTP/2 200 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "status line"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\n Folded: x\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n{}", "conflicting Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n{}", "is not a length"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n", "reply head over 64 KiB"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX", "not followed by CRLF"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "transfer coding"),
    (ok(b"{}", "Content-Encoding: br"), "an encoding not asked for"),
    (ok(b"not gzip", "Content-Encoding: gzip"), "does not decompress"),
    (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
])
def test_replies_that_break_the_protocol_are_named(reply, says) -> None:
    [got], _ = exchange(lambda n, r: [reply], [b"{}"], read_timeout=0.5)
    assert isinstance(got, MalformedReply) and says in str(got)


def test_an_ended_connection_is_told_apart_by_where_it_ended() -> None:
    replies, _ = exchange(lambda n, r: [
        [b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{", CLOSE],   # inside the body
        [b"HTTP/1.1 200", CLOSE],                                      # inside the head
        None][n], [b"{}"] * 3)                                          # before a word
    assert [type(r) for r in replies] == [TruncatedReply, TruncatedReply, ServerDisconnected]
    assert isinstance(replies[2], ConnectionResetError)   # what providers._dropped looks for


def test_a_connection_the_server_closed_while_idle_is_not_used() -> None:
    """A server that closes a keep-alive connection after its reply (an idle timeout): the
    next request goes on a new connection, not the dead one (no spurious "dropped")."""
    async def go() -> tuple[list[bytes], int]:
        async with RawServer(lambda n, r: [ok(b'{"n": %d}' % n), CLOSE]) as server:
            p = pool(server.port)
            got = [(await p.post("/", b"{}")).body]
            await asyncio.sleep(0.05)
            got.append((await p.post("/", b"{}")).body)
            await p.close()
            return got, server.connections
    got, connections = asyncio.run(go())
    assert got == [b'{"n": 0}', b'{"n": 1}'] and connections == 2


def test_idle_connections_expire() -> None:
    async def go() -> int:
        async with RawServer(lambda n, r: [ok()]) as server:
            p = pool(server.port, keepalive_expiry=0.05)
            await p.post("/", b"{}")
            await asyncio.sleep(0.1)
            await p.post("/", b"{}")
            await p.close()
            return server.connections
    assert asyncio.run(go()) == 2


def test_the_read_timeout_is_per_read() -> None:
    reply = ok(b'{"slow": true}')
    trickle = [reply[i:i + 8] for i in range(0, len(reply), 8)]
    paced = [piece for p in trickle for piece in (p, b"")]   # 50 ms between pieces
    [got], _ = exchange(lambda n, r: paced, [b"{}"], read_timeout=0.3)
    assert got.body == b'{"slow": true}'   # ~0.5 s in all, never 0.3 s without a byte
    [silent], _ = exchange(lambda n, r: [b"", b"", b"", b"", ok()], [b"{}"], read_timeout=0.1)
    assert isinstance(silent, asyncio.TimeoutError)


def test_connect_errors_and_timeouts() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def refused() -> BaseException:
        p = pool(port)
        try:
            await p.post("/", b"{}")
        except BaseException as exc:  # noqa: BLE001
            return exc
        raise AssertionError("connected to nothing")
    assert isinstance(asyncio.run(refused()), ConnectionRefusedError)


def test_a_cancelled_call_never_leaves_its_connection_for_reuse() -> None:
    async def go() -> tuple[bytes, int]:
        async with RawServer(lambda n, r: [b"", b"", ok(b'{"late": %d}' % n)]) as server:
            p = pool(server.port)
            task = asyncio.ensure_future(p.post("/", b"{}"))
            await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not p._idle
            second = await p.post("/", b"{}")   # its own connection: not the late first reply
            await p.close()
            return second.body, server.connections
    body, connections = asyncio.run(go())
    assert body == b'{"late": 1}' and connections == 2


def test_bytes_beyond_a_reply_end_the_connection() -> None:
    replies, server = exchange(lambda n, r: [ok() + b"HTTP/1.1 200 OK\r\n"], [b"{}", b"{}"])
    assert [r.status for r in replies] == [200, 200] and server.connections == 2


@pytest.mark.parametrize("value", ["Bearer sk-SECRET\r\nX-Evil: 1", "Bearer sk-SECRET\n",
                                   "Bearer sk-SECRET\u2026"])
def test_headers_that_could_inject_are_refused_without_their_value(value, monkeypatch) -> None:
    with pytest.raises(ValueError) as err:
        Http1Pool("127.0.0.1", 80, {"Authorization": value},
                  limit=1, keepalive_expiry=5, connect_timeout=1, read_timeout=1)
    assert "Authorization" in str(err.value) and "sk-SECRET" not in str(err.value)
    # and a key like that stops the provider as it is made: one line, naming the setting
    from draco_cli.llm.errors import ModelSpecError
    from draco_cli.llm.providers import make_provider

    monkeypatch.setenv("OPENAI_API_KEY", value.removeprefix("Bearer "))
    with pytest.raises(ModelSpecError) as made:
        make_provider("openai/m", base_url="http://127.0.0.1:9/v1")
    assert "OPENAI_API_KEY" in str(made.value) and "sk-SECRET" not in str(made.value)


def test_the_host_header_names_ipv6_and_default_ports() -> None:
    assert Http1Pool("::1", 8000, {}, limit=1, keepalive_expiry=5, connect_timeout=1,
                     read_timeout=1)._head_rest.startswith(b"Host: [::1]:8000\r\n")
    assert Http1Pool("llm.local", 80, {}, limit=1, keepalive_expiry=5, connect_timeout=1,
                     read_timeout=1)._head_rest.startswith(b"Host: llm.local\r\n")


# -- the parser, fed in random fragments ------------------------------------------------------

class _Sink(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.aborted = False

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def _parse_in_pieces(raw: bytes, cuts: list[int]) -> tuple[Any, bool]:
    loop = asyncio.new_event_loop()
    try:
        conn = _Connection(loop, read_timeout=60)
        sink = _Sink()
        conn.connection_made(sink)
        fut = conn.send(b"request")
        points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
        for a, b in zip(points, points[1:]):
            if fut.done():
                break
            conn.data_received(raw[a:b])
        if not fut.done():
            conn.connection_lost(None)
        exc = fut.exception()
        return (exc if exc is not None else fut.result()), conn.closed
    finally:
        loop.close()


replies = st.builds(
    lambda body, framing, sizes, extra: (body, {
        "length": ok(body, *extra),
        "length, bare LF": ok(body, *extra).replace(b"\r\n", b"\n", 3),
        "chunked": chunked(body, sizes),
        "eof": b"HTTP/1.1 200 OK\r\n" + "".join(f"{h}\r\n" for h in extra).encode()
               + b"\r\n" + body,
    }[framing], framing),
    st.binary(max_size=300), st.sampled_from(["length", "length, bare LF", "chunked", "eof"]),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
    st.lists(st.sampled_from(["X-A: 1", "Server: t", "Date: now", "Connection: keep-alive"]),
             max_size=3))


@settings(max_examples=300, deadline=None)
@given(replies, st.lists(st.integers(0, 10_000), max_size=12))
def test_any_fragmentation_gives_the_same_reply(reply, cuts) -> None:
    body, raw, framing = reply
    got, closed = _parse_in_pieces(raw, cuts)
    whole, _ = _parse_in_pieces(raw, [])
    assert not isinstance(got, Exception), got
    assert got.body == body == whole.body and got.status == 200
    assert closed == (framing == "eof")   # only a body without an end ends the connection
