"""Calls through an SDK's public low-level client (the Anthropic Messages API, OpenAI batch
files, and OpenAI calls whose authentication or proxy the SDK handles), their typed errors
mapped to the same ``Retryable`` / ``RequestRejected`` as draco's own route."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any, TypeVar

from draco_cli.llm.errors import Retryable
from draco_cli.llm.providers.http import refused, status_failure, tls_context, transport_failure

T = TypeVar("T")


def http_client(sdk: ModuleType, concurrency: int, timeout: float) -> Any:
    """One long-lived client per endpoint on the SDK's aiohttp transport, its pool sized to the
    concurrency (the SDK's own transport if the aiohttp extra is missing)."""
    import httpx2

    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    try:
        return sdk.DefaultAioHttpClient(limits=limits, timeout=timeout, verify=tls_context())
    except RuntimeError:
        return sdk.DefaultAsyncHttpxClient(limits=limits, timeout=timeout, verify=tls_context())


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
    except (sdk.RateLimitError, sdk.InternalServerError) as exc:
        raise status_failure(exc.status_code, _sdk_body(exc), str(exc.message),
                             exc.response.headers, label, busy=True) from None
    except sdk.APITimeoutError as exc:
        raise transport_failure(exc) from None
    except sdk.APIConnectionError as exc:
        if refused(exc):
            raise Retryable("connection refused (is the server running?)",
                            kind="refused") from None
        raise Retryable(f"connection error ({type(exc.__cause__).__name__})",
                        kind="connection") from None
    except sdk.APIStatusError as exc:
        raise status_failure(exc.status_code, _sdk_body(exc), str(exc.message),
                             exc.response.headers, label, busy=False) from None


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
    import httpx2

    sent = {"content": body} if isinstance(body, bytes) else {"body": body}
    start = time.perf_counter()
    raw = await mapped(sdk, label, lambda: client.post(path, cast_to=httpx2.Response, **sent))
    latency = time.perf_counter() - start
    return _json_of(raw), latency


async def get_json(sdk: ModuleType, client: Any, path: str, label: str) -> dict[str, Any]:
    import httpx2

    return _json_of(await mapped(sdk, label, lambda: client.get(path, cast_to=httpx2.Response)))


async def get_text(sdk: ModuleType, client: Any, path: str, label: str,
                   accept: str | None = None) -> str:
    import httpx2

    options = {"headers": {"Accept": accept}} if accept else {}

    async def call() -> str:
        raw = await client.get(path, cast_to=httpx2.Response, options=options)
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
