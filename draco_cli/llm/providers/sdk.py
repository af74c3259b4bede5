"""Calls through an SDK's public low-level client (the Anthropic Messages API, OpenAI batch
files, and OpenAI calls whose authentication or proxy the SDK handles), their typed errors
mapped to the same ``Retryable`` / ``RequestRejected`` as draco's own route, and their replies
held to the same bounds (``--max-reply-mib``, decompressed; Retry-After and token counts are
checked in the code both routes share)."""

from __future__ import annotations

import contextvars
import json
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any, TypeVar

import httpx2

from draco_cli.llm.errors import ReplyRefused, Retryable
from draco_cli.llm.providers.http import (refused, status_failure, tls_context, too_large,
                                          transport_failure)

T = TypeVar("T")

# What draco inflates itself, bounded: an encoding it did not ask for is refused, so brotli or
# zstd (which httpx inflates whole, a chunk at a time, if their packages are installed) never
# reach a decoder that cannot stop at the bound.
ACCEPT_ENCODING = "gzip, deflate"

# Set while a batch result file is read (``get_text``): a file of every line's reply grows with
# the batch, so the per-reply bound does not apply to it (each line is still checked).
_WHOLE_FILE: contextvars.ContextVar[bool] = contextvars.ContextVar("draco_whole_file",
                                                                   default=False)


def http_client(sdk: ModuleType, concurrency: int, timeout: float, max_bytes: int) -> Any:
    """One long-lived client per endpoint on the SDK's aiohttp transport, its pool sized to the
    concurrency (the SDK's own transport if the aiohttp extra is missing). Each reply passes
    ``bounded_reply``: no body over ``max_bytes`` (decompressed) is ever held."""
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    common: dict[str, Any] = dict(limits=limits, timeout=timeout, verify=tls_context(),
                                  headers={"Accept-Encoding": ACCEPT_ENCODING},
                                  event_hooks={"response": [bounded_reply(max_bytes)]})
    try:
        return sdk.DefaultAioHttpClient(**common)
    except RuntimeError:
        return sdk.DefaultAsyncHttpxClient(**common)


def bounded_reply(limit: int) -> Callable[[Any], Awaitable[None]]:
    """An httpx response hook (run before the body is read): a declared length over ``limit``
    is refused at once, and the body is read through ``_Bounded``, which inflates it itself
    and gives up (``ReplyRefused``, not retried) as soon as it passes ``limit`` bytes."""

    async def hook(response: Any) -> None:
        if _WHOLE_FILE.get():
            return
        declared = response.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise ReplyRefused(too_large(limit, f"its Content-Length is {int(declared):,} "
                                                "bytes"))
        codings = [c.strip().lower() for c in response.headers.get_list(
            "content-encoding", split_commas=True) if c.strip().lower() not in ("", "identity")]
        for c in codings:
            if c not in ("gzip", "x-gzip", "deflate"):
                raise ReplyRefused(f"reply not used: its Content-Encoding {c[:40]!r} is not one "
                                   f"draco asked for ({ACCEPT_ENCODING})")
        if codings:
            del response.headers["content-encoding"]   # inflated here, so not again by httpx
        response.stream = _bounded_stream(response.stream, limit, codings)

    return hook


def _bounded_stream(inner: Any, limit: int, codings: list[str]) -> Any:
    class Bounded(httpx2.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            # content codings are listed in the order applied: undone in reverse
            inflaters = [_Inflater(c) for c in reversed(codings)]
            size = 0
            async for chunk in inner:
                for z in inflaters:
                    chunk = z.feed(chunk, limit - size)
                size += len(chunk)
                if size > limit:
                    raise ReplyRefused(too_large(limit, "its body (decompressed) is larger"))
                if chunk:
                    yield chunk

        async def aclose(self) -> None:
            await inner.aclose()

    return Bounded()


class _Inflater:
    """One content coding undone with zlib, never producing more than it is allowed."""

    def __init__(self, coding: str) -> None:
        self.deflate = coding == "deflate"
        # gzip, or deflate as most servers send it (zlib-wrapped); raw deflate is tried next
        self.z = zlib.decompressobj(zlib.MAX_WBITS | (0 if self.deflate else 16))
        self.started = False

    def feed(self, data: bytes, room: int) -> bytes:
        """At most ``room + 1`` bytes of output: one more than allowed says "too large"."""
        try:
            out = self.z.decompress(data, max(room, 0) + 1)
        except zlib.error:
            if not (self.deflate and not self.started):
                raise Retryable("connection error (a compressed body that does not inflate)",
                                kind="connection") from None
            self.z = zlib.decompressobj(-zlib.MAX_WBITS)
            out = self.z.decompress(data, max(room, 0) + 1)
        self.started = True
        return out


def _sdk_body(exc: Any) -> object:
    """An SDK status error's body: the JSON it parsed (its ``error`` object), else the text."""
    body = getattr(exc, "body", None)
    if body is None:
        response = getattr(exc, "response", None)
        try:
            body = response.text if response is not None else None
        except Exception:  # noqa: BLE001 - a body we cannot read is simply not shown
            body = None
    return body


async def mapped(sdk: ModuleType, label: str, call: Callable[[], Awaitable[T]]) -> T:
    """Await ``call()`` with the SDK's typed errors mapped once, for single calls and batch
    operations alike: failures worth retrying become ``Retryable``, a request the server
    rejects ``RequestRejected`` (its reason in the message). Both SDKs name them alike."""
    try:
        return await call()
    except sdk.APITimeoutError as exc:
        raise transport_failure(exc) from None
    except sdk.APIConnectionError as exc:
        # the anthropic SDK wraps whatever its send raised, ``bounded_reply``'s refusal too
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ReplyRefused):
            raise cause from None
        if refused(exc):
            raise Retryable("connection refused (is the server running?)",
                            kind="refused") from None
        raise Retryable(f"connection error ({type(exc.__cause__).__name__})",
                        kind="connection") from None
    except sdk.APIStatusError as exc:
        raise status_failure(exc.status_code, _sdk_body(exc), str(exc.message),
                             exc.response.headers, label) from None


def _json_of(raw: Any) -> dict[str, Any]:
    try:
        data: dict[str, Any] = raw.json()
        return data
    except ValueError:
        raise Retryable("the server sent a body that is not JSON") from None


async def post_json(sdk: ModuleType, client: Any, path: str, body: dict[str, Any] | bytes,
                    label: str) -> tuple[dict[str, Any], float]:
    """POST through the SDK's public low-level ``post`` (its transport, auth and typed errors,
    without re-walking the request through typed params and the reply through pydantic, which
    cost more CPU than everything else per call at high concurrency). A body already serialised
    (bytes) is sent as it is. Returns (JSON reply, latency)."""
    sent = {"content": body} if isinstance(body, bytes) else {"body": body}
    start = time.perf_counter()
    raw = await mapped(sdk, label, lambda: client.post(path, cast_to=httpx2.Response, **sent))
    latency = time.perf_counter() - start
    return _json_of(raw), latency


async def get_json(sdk: ModuleType, client: Any, path: str, label: str) -> dict[str, Any]:
    return _json_of(await mapped(sdk, label, lambda: client.get(path, cast_to=httpx2.Response)))


async def get_text(sdk: ModuleType, client: Any, path: str, label: str,
                   accept: str | None = None) -> str:
    options = {"headers": {"Accept": accept}} if accept else {}

    async def call() -> str:
        token = _WHOLE_FILE.set(True)
        try:
            raw = await client.get(path, cast_to=httpx2.Response, options=options)
        finally:
            _WHOLE_FILE.reset(token)
        text: str = raw.text
        return text

    return await mapped(sdk, label, call)


def jsonl(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                raise Retryable("a batch result file with a line that is not JSON") from None
    return out
