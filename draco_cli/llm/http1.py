"""HTTP/1.1 POSTs over plain TCP, for OpenAI-compatible servers reached by ``http://``.

Self-hosted servers (vLLM, SGLang, llama.cpp, TGI) are where a client's own cost per call
shows: they answer in tens of milliseconds at concurrencies in the hundreds. aiohttp's request
path costs about 0.2 ms of CPU a call, and on Python < 3.12 it writes a request's body in a task
of its own, one event-loop pass after the call asked for it: with 64 calls in flight that pass
waits behind the other replies of a burst, on every call of the chain that sets a run's wall
(docs/llm.md, Throughput). Here a request is one ``transport.write`` made in the calling task's
own step, and a reply is parsed from the bytes as they arrive: ~0.07 ms a call.

Deliberately small: one request at a time per connection (no pipelining), keep-alive
connections reused newest first and dropped after ``keepalive_expiry`` idle seconds,
Content-Length or chunked replies (or a body to the end of the connection), gzip and deflate
(the encodings asked for), a timeout per connect and per read. TLS URLs, proxies and anything
else stay on aiohttp (``providers.DirectPost``). A reply that breaks the protocol is an error
naming what broke, never a guess; a connection is reused only after a reply that was whole and
said nothing against it.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass

MAX_HEAD = 64 * 1024        # status line and headers of one reply
MAX_CHUNK_LINE = 4096       # a chunk-size line with its extensions


class MalformedReply(Exception):
    """The server's bytes are not an HTTP/1.x reply (or not one this client can read)."""


class TruncatedReply(Exception):
    """The connection ended inside a reply's body."""


class ServerDisconnected(ConnectionResetError):
    """The connection ended before a reply's head arrived."""

    def __init__(self) -> None:
        super().__init__("server disconnected")


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]   # names lowercased; repeated fields joined with ", "
    body: bytes


def _token_list(value: str | None) -> list[str]:
    return [t.strip().lower() for t in value.split(",")] if value else []


def _content_length(value: str) -> int:
    # "n" or, from some proxies, "n, n": any other repetition or form is unreadable
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1:
        raise MalformedReply(f"conflicting Content-Length values {value!r}")
    [v] = values
    if not v.isdigit() or not v.isascii() or len(v) > 18:
        raise MalformedReply(f"Content-Length {v[:40]!r} is not a length")
    return int(v)


class _Connection(asyncio.Protocol):
    """One TCP connection: at most one request in flight, its reply parsed as bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float) -> None:
        self.loop = loop
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future[Response] | None = None
        self._buf = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self._reset()

    def _reset(self) -> None:
        self._status = 0                        # 0 until the final reply's head is parsed
        self._headers: dict[str, str] = {}
        self._keep = False
        self._length: int | None = None         # None: chunked or to the end of the connection
        self._chunked = False
        self._trailers = False
        self._body = bytearray()

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()   # bytes nobody asked for: this connection's framing is lost
            return
        self._last_read = self.loop.time()
        self._buf += data
        try:
            done = self._parse()
        except MalformedReply as exc:
            self._fail(exc)
            return
        if done:
            self._finish()

    def eof_received(self) -> bool:
        self.closed = True   # not to be taken from the pool before connection_lost runs
        return False   # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.waiter is None or self.waiter.done():
            self._cancel_timer()
            return
        if self._status and self._length is None and not self._chunked and exc is None:
            self._finish()   # a body that runs to the end of the connection
        elif self._status or self._buf:
            self._fail(TruncatedReply("the connection ended inside the reply"))
        else:
            self._fail(ServerDisconnected())

    # -- one exchange ---------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Open and not closing: a request written now reaches the server."""
        return not self.closed and self.transport is not None \
            and not self.transport.is_closing()

    def send(self, data: bytes) -> asyncio.Future[Response]:
        self._reset()
        waiter = self.waiter = self.loop.create_future()
        transport = self.transport
        if transport is None or not self.usable:
            # ended between its connect (or its last reply) and this request
            self._fail(ServerDisconnected())
            return waiter
        transport.write(data)
        self._last_read = self.loop.time()
        self._timer = self.loop.call_at(self._last_read + self.read_timeout, self._on_timer)
        return waiter

    def _on_timer(self) -> None:
        # re-armed lazily: a read only notes its time, the timer checks it when it fires
        quiet_until = self._last_read + self.read_timeout
        if self.loop.time() < quiet_until:
            self._timer = self.loop.call_at(quiet_until, self._on_timer)
            return
        self._timer = None
        self._fail(asyncio.TimeoutError())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _finish(self) -> None:
        raw, self._body = bytes(self._body), bytearray()   # an idle connection holds no reply
        try:
            body = _decoded(raw, self._headers.get("content-encoding"))
        except MalformedReply as exc:
            self._fail(exc)
            return
        waiter, self.waiter = self.waiter, None
        self._cancel_timer()
        if self._buf or not self._keep:
            self.close()   # bytes beyond the reply, or a reply that said so: not reused
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self._status, self._headers, body))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        self._cancel_timer()
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()   # a connection is closed only when it cannot be reused
            self.transport = None

    # -- parsing --------------------------------------------------------------------------

    def _parse(self) -> bool:
        """Consume what has arrived; True once the whole reply is in."""
        while not self._status:
            if not self._parse_head():
                return False
        if self._chunked:
            return self._parse_chunks()
        if self._length is None:
            self._body += self._buf
            self._buf.clear()
            return False   # to the end of the connection
        need = self._length - len(self._body)
        if need:
            take = self._buf[:need]
            self._body += take
            del self._buf[:len(take)]
        return len(self._body) == self._length

    def _parse_head(self) -> bool:
        # the head ends at its first empty line; a bare LF ends a line too (RFC 9112 2.2)
        ends = [(i, n) for i, n in ((self._buf.find(b"\n\r\n"), 3), (self._buf.find(b"\n\n"), 2))
                if i >= 0]
        if not ends:
            if len(self._buf) > MAX_HEAD:
                raise MalformedReply(f"reply head over {MAX_HEAD // 1024} KiB")
            return False
        end, blank = min(ends)
        if end > MAX_HEAD:
            raise MalformedReply(f"reply head over {MAX_HEAD // 1024} KiB")
        head = bytes(self._buf[:end]).decode("latin-1")
        del self._buf[:end + blank]
        status_line, *lines = (line.removesuffix("\r") for line in head.split("\n"))
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if version not in ("HTTP/1.1", "HTTP/1.0") or not (code.isdigit() and code.isascii()) \
                or rest[3:4] not in ("", " "):
            raise MalformedReply(f"status line {status_line[:80]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip() or "\x00" in line:
                raise MalformedReply(f"header line {line[:80]!r}")
            key = name.lower()
            value = value.strip(" \t")
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        if 100 <= status < 200:
            if status == 101:
                raise MalformedReply("the server switched protocols")
            return True   # an interim reply (100 Continue, 103 Early Hints): the real one follows
        connection = _token_list(headers.get("connection"))
        self._keep = "close" not in connection if version == "HTTP/1.1" \
            else "keep-alive" in connection
        coding = _token_list(headers.get("transfer-encoding"))
        if status in (204, 304):
            self._length = 0
        elif coding:
            # chunked last means chunked; any other coding runs to the end of the connection
            self._chunked = coding[-1] == "chunked"
            if self._chunked and coding != ["chunked"]:
                raise MalformedReply(f"transfer coding {headers['transfer-encoding']!r}")
            if "content-length" in headers:
                self._keep = False   # both framings named: read by the chunks, then close
        elif "content-length" in headers:
            self._length = _content_length(headers["content-length"])
        else:
            self._keep = False
        self._headers = headers
        self._status = status
        return True

    def _parse_chunks(self) -> bool:
        buf = self._buf
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                if len(buf) > MAX_CHUNK_LINE:
                    raise MalformedReply("chunk-size line too long")
                return False
            if self._trailers:
                del buf[:line_end + 2]
                if line_end == 0:
                    return True   # the empty line after the last chunk (and any trailers)
                continue
            size_field = bytes(buf[:line_end]).split(b";", 1)[0].strip()
            if not size_field or len(size_field) > 16 or \
                    size_field.strip(b"0123456789abcdefABCDEF"):
                raise MalformedReply(f"chunk size {size_field[:20]!r}")
            size = int(size_field, 16)
            if size == 0:
                del buf[:line_end + 2]
                self._trailers = True
                continue
            start = line_end + 2
            if len(buf) < start + size + 2:
                return False   # wait for the whole chunk and its CRLF
            if buf[start + size:start + size + 2] != b"\r\n":
                raise MalformedReply("chunk not followed by CRLF")
            self._body += buf[start:start + size]
            del buf[:start + size + 2]


def _decoded(body: bytes, encoding: str | None) -> bytes:
    if not body:
        return body   # an empty body is empty in every encoding (a 204, an error with none)
    codings = [c for c in _token_list(encoding) if c != "identity"]
    for coding in reversed(codings):
        try:
            if coding in ("gzip", "x-gzip"):
                body = zlib.decompress(body, 16 + zlib.MAX_WBITS)
            elif coding == "deflate":
                try:
                    body = zlib.decompress(body)
                except zlib.error:   # raw deflate, as some servers send it
                    body = zlib.decompress(body, -zlib.MAX_WBITS)
            else:
                raise MalformedReply(f"a body in {coding!r}, an encoding not asked for")
        except zlib.error as exc:
            raise MalformedReply(f"a {coding} body that does not decompress ({exc})") from None
    return body


def check_headers(headers: dict[str, str]) -> None:
    """Refuse a header HTTP cannot carry as given, naming it, never its value (a key)."""
    for name, value in headers.items():
        bad = not name or any(c in name for c in ' \t\r\n:\x00') or \
            any(c in value for c in '\r\n\x00')
        if not bad:
            try:
                (name + value).encode("latin-1")
            except UnicodeEncodeError:
                bad = True
        if bad:
            raise ValueError(f"header {name[:40]!r} holds a character HTTP does not allow "
                             "(a line break, NUL, or a character beyond Latin-1)")


def _header_block(headers: dict[str, str]) -> bytes:
    check_headers(headers)
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")


class Http1Pool:
    """Keep-alive connections to one ``host:port``, at most ``limit`` open at a time."""

    def __init__(self, host: str, port: int, headers: dict[str, str], *, limit: int,
                 keepalive_expiry: float, connect_timeout: float, read_timeout: float) -> None:
        self.host, self.port = host, port
        self.limit = max(1, limit)
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        authority = f"[{host}]" if ":" in host else host
        if port != 80:
            authority += f":{port}"
        # aiohttp's order: Host, the caller's headers, then what the transport adds
        sent = {"Host": authority, **headers, "Accept-Encoding": "gzip, deflate"}
        self._head_rest = _header_block(sent)
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(self.limit)
        self._closed = False

    def _take_idle(self, now: float) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()   # newest first: the least likely to have expired
            if conn.usable and now - conn.idle_since < self.keepalive_expiry:
                return conn
            conn.close()
        return None

    async def post(self, target: str, body: bytes) -> Response:
        """POST ``body`` (JSON) to ``target`` (path and query) and return the whole reply."""
        if self._closed:
            raise RuntimeError("the connection pool is closed")
        loop = asyncio.get_running_loop()
        await self._slots.acquire()   # no wait (and no loop pass) while a slot is free
        try:
            conn = self._take_idle(loop.time()) or await self._connect(loop)
            request = b"".join((b"POST ", target.encode("ascii"), b" HTTP/1.1\r\n",
                                self._head_rest, b"Content-Length: %d\r\n\r\n" % len(body),
                                body))
            try:
                reply = await conn.send(request)
            except BaseException:
                conn.close()   # cancelled or failed mid-exchange: never reused
                raise
        finally:
            self._slots.release()
        if self._closed:
            conn.close()
        elif not conn.closed:
            conn.idle_since = loop.time()
            self._idle.append(conn)
        return reply

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        _, conn = await asyncio.wait_for(loop.create_connection(
            lambda: _Connection(loop, self.read_timeout), self.host, self.port),
            self.connect_timeout)
        return conn

    async def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()
