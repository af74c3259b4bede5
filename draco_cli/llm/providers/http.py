"""The HTTP side every provider shares: draco's aiohttp route for single calls to
OpenAI-compatible servers, the SDKs' TLS context, and what a failed call means to the client
(``Retryable`` / ``RequestRejected``) whichever route it took."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import aiohttp
import httpx2

from draco_cli.llm.errors import ModelSpecError, ReplyRefused, RequestRejected, Retryable
from draco_cli.llm.keys import scrub


def _in_chain(exc: BaseException, kind: type[BaseException], *words: str) -> bool:
    """An exception of ``kind``, or one whose text holds one of ``words``, among the first
    eight of ``exc``'s cause chain."""
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return False
        if isinstance(cur, kind) or any(w in str(cur).lower() for w in words):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def refused(exc: BaseException) -> bool:
    """A connection refused somewhere in the exception's cause chain (no server listening)."""
    return _in_chain(exc, ConnectionRefusedError, "refused", "connect call failed")


def unresolved(exc: BaseException) -> bool:
    """The server's host name has no address (a typo in --base-url, or no DNS)."""
    return _in_chain(exc, socket.gaierror, "name or service not known",
                     "nodename nor servname", "name resolution", "no address associated")


def _dropped(exc: BaseException) -> bool:
    """The server closed the connection mid-request, which the SDKs' aiohttp transport reports
    as a connect "timeout": it is a dropped connection, not a call still running upstream."""
    return _in_chain(exc, ConnectionResetError, "server disconnected")


def retry_after_of(headers: Any) -> float | None:
    """The seconds a reply's Retry-After asks for: None when absent or not a number (nan
    too), 0 for a negative one; a huge or infinite one is kept (``RetryPolicy`` caps it)."""
    if not headers:
        return None
    try:
        seconds = float(headers.get("retry-after"))
    except (TypeError, ValueError):
        return None
    return None if math.isnan(seconds) else max(seconds, 0.0)


_TLS: dict[tuple[str | None, str | None], Any] = {}


def tls_context() -> Any:
    """The SDKs' default TLS context (httpx's), made once per process for each value of
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` (why: docs/decisions.md, "One TLS context per
    process"). A context is only read by connections, so one is shared by every client, loop
    and thread."""
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    ctx = _TLS.get(key)
    if ctx is None:
        ctx = _TLS[key] = httpx2.create_ssl_context(verify=True, trust_env=True)
    return ctx


class AioHttpPost:
    """Single calls posted by draco itself on one long-lived aiohttp session per endpoint, its
    pool sized to the concurrency, with the SDK client's headers, timeouts, TLS context and
    failure mapping. Why not the SDK, and what is kept equal: docs/decisions.md, "Single
    `openai/` calls go out on draco's own aiohttp session". A URL behind a proxy stays on the
    SDK path (``env_proxy``)."""

    def __init__(self, headers: dict[str, str], concurrency: int, timeout: float,
                 max_bytes: int) -> None:
        for name, value in headers.items():
            if any(c in value for c in "\r\n\0"):   # e.g. a key pasted with its line break
                raise ModelSpecError(f"header {name[:40]!r} holds a character HTTP does not "
                                     "allow (a line break or NUL): check OPENAI_API_KEY and "
                                     "the OPENAI_ settings")
        self.headers = headers
        self.concurrency = concurrency
        self.timeout_s = timeout
        self.max_bytes = max_bytes
        self._session: Any = None

    def _open(self) -> Any:
        # as the SDK's transport: httpx's TLS context (its CA bundle, SSL_CERT_FILE), its
        # keep-alive expiry, a timeout per connect and per read; and one for the whole call
        # too: a server trickling bytes (keep-alive spaces, a slow stream) never trips a read
        # timeout, and --timeout promises the call is given up. A call given up closes its
        # connection, which is what makes vLLM (and llama.cpp's llama-server) abort it.
        connector = aiohttp.TCPConnector(
            limit=self.concurrency, keepalive_timeout=httpx2.Limits().keepalive_expiry or 5.0,
            ssl=tls_context())
        self.timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.timeout_s,
                                             sock_read=self.timeout_s, connect=self.timeout_s)
        # trust_env off, as the SDK's own aiohttp session: it would look up netrc and proxy
        # settings in a worker thread on every request (a URL behind a proxy from the
        # environment is never sent this way: ``env_proxy``)
        self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def post(self, url: str, data: bytes,
                   label: str) -> tuple[dict[str, Any], float, str | None]:
        """POST ``data`` (JSON bytes); return (JSON reply, latency, the reply as text when it
        is UTF-8: logged as received instead of encoded again)."""
        session = self._session or self._open()
        start = time.perf_counter()
        try:
            async with session.post(url, data=data, headers=self.headers, timeout=self.timeout,
                                    allow_redirects=False) as resp:
                raw = await bounded_body(resp, self.max_bytes)
                status, headers = resp.status, resp.headers
                # only an error body is decoded by its charset: Content-Type is parsed (a
                # few µs in aiohttp) only then
                charset = None if 200 <= status < 300 else resp.charset
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise transport_failure(exc) from None
        except aiohttp.ClientPayloadError:
            raise Retryable("connection error (ReadError)", kind="connection") from None
        except aiohttp.ClientError as exc:
            raise Retryable(f"connection error ({type(exc).__name__})",
                            kind="connection") from None
        return _reply(status, headers, raw, charset, time.perf_counter() - start, label)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def bounded_body(resp: Any, limit: int) -> bytes:
    """A reply's body, decompressed, read as it arrives and given up on (``ReplyRefused``) as
    soon as it passes ``limit`` bytes, so neither a huge body (chunked or not) nor a small
    compressed one inflating to gigabytes is ever held (aiohttp inflates a chunk at a time)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise ReplyRefused(too_large(limit, f"its Content-Length is {declared:,} bytes"))
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ReplyRefused(too_large(limit, "its body (decompressed) is larger"))
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def too_large(limit: int, what: str) -> str:
    return (f"reply not used: {what}, over --max-reply-mib {limit / 2**20:g} MiB "
            "(raise it if the server's replies are really that large)")


def _reply(status: int, headers: Any, raw: bytes, charset: str | None, latency: float,
           label: str) -> tuple[dict[str, Any], float, str | None]:
    """A reply's JSON (and its text, logged as received) or the failure its status means."""
    if not 200 <= status < 300:
        body, message = _sdk_error(status, raw, charset)
        raise status_failure(status, body, message, headers, label)
    try:
        text: str | None = raw.decode()
    except UnicodeDecodeError:
        text = None   # JSON in another encoding: json.loads finds it, the log re-encodes
    try:
        data_: dict[str, Any] = json.loads(text if text is not None else raw)
    except ValueError:
        raise Retryable("the server sent a body that is not JSON") from None
    return data_, latency, text


def _sdk_error(status: int, raw: bytes, charset: str | None) -> tuple[object, str]:
    """An error reply's (body, message) as the openai SDK makes them: the parsed JSON's
    ``error`` object (else the JSON, else the text) and "Error code: N[ - its message]"."""
    text = raw.decode(charset or "utf-8", errors="replace").strip()
    message = f"Error code: {status}"
    try:
        parsed = json.loads(text)
    except ValueError:
        return text, message
    body = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    reason = body.get("message") if isinstance(body, dict) else None
    if isinstance(reason, str) and reason:
        message += f" - {reason}"
    return body, message


def env_proxy(url: str) -> str | None:
    """The proxy the environment (HTTPS_PROXY, NO_PROXY ...) names for ``url``, if any: the
    SDK's httpx client routes through it, so such calls keep to the SDK path."""
    parts = urlsplit(url)
    proxy = getproxies().get(parts.scheme) or getproxies().get("all")
    if not proxy or (parts.hostname and proxy_bypass(parts.hostname)):
        return None
    return proxy


# Status codes worth another attempt besides 429 and 5xx (529 = Anthropic "overloaded").
RETRY_STATUS = (408, 409, 425, 529)


def body_text(body: object) -> str:
    """The server's error body as text (scrubbed, bounded), for the terminal and the log."""
    if body is None:
        return ""
    text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return scrub(text[:1000]) or ""


def status_failure(status: int, body: object, message: str, headers: Any, label: str) -> Exception:
    """What an HTTP error status means to the client, whichever transport got it: a busy
    server (429, 5xx) and the other retry statuses are ``Retryable``; anything else is the
    server rejecting the request itself (``RequestRejected``, its reason in the message).
    ``body`` and ``message`` are as the SDKs make them (the ``error`` object or the text;
    "Error code: N - reason")."""
    text = body_text(body)
    if status == 429 or status >= 500:
        return Retryable(f"HTTP {status}" + (f": {brief(body, message)}" if text else ""),
                         retry_after_of(headers), body=text, status=status)
    if status in RETRY_STATUS:
        return Retryable(f"HTTP {status}", retry_after_of(headers), body=text, status=status)
    # A request the server rejects as malformed is not retried: its reason is the message.
    return RequestRejected(f"{label}: HTTP {status}: {brief(body, message)}", body=text,
                           status=status)


def transport_failure(exc: BaseException) -> Retryable:
    """A call that got no HTTP reply: refused, dropped, or timed out. The SDKs' aiohttp
    transport reports all three as a connect "timeout", so they are told apart by the cause."""
    if refused(exc):
        return Retryable("connection refused (is the server running?)", kind="refused")
    if unresolved(exc):   # as a refusal: asked twice, not for a minute
        return Retryable("host not found (check the URL's host name)", kind="refused")
    if _dropped(exc):
        return Retryable("connection dropped by the server", kind="connection")
    return Retryable("timeout (no reply within --timeout)", kind="timeout")


def brief(body: object, message: str) -> str:
    """The server's error message, without any key it may quote back."""
    text = message
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
    # One line: servers put tracebacks and pretty-printed validation errors in their bodies.
    return scrub(" ".join(text.split())[:300]) or ""
