"""Providers: one small class per API, each turning an ``LLMRequest`` into one HTTP call.

Retries, caching, validation, cost and concurrency live once, in ``client.py``; a provider
only builds the request body, calls its SDK (imported lazily), normalises the reply and says
which errors are worth retrying. SDK-level retries are off so every attempt is ours to count.
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from draco_cli.llm.errors import LLMError, ModelSpecError, ReplayMiss
from draco_cli.llm.types import Choice, LLMRequest, Reply, Usage

if TYPE_CHECKING:
    from draco_cli.llm.http1 import Http1Pool

PROVIDERS = ("openai", "anthropic", "replay")

# How a request asks for a JSON answer (``--structured-output``). Servers differ; `draco llm
# check` probes which of these a server accepts and prints the one to use.
STRUCTURED_FORMS = {
    "auto": "json-schema for openai/ and OpenAI-compatible servers, output-format for anthropic/",
    "json-schema": "OpenAI response_format json_schema, strict (OpenAI, vLLM, SGLang)",
    "json-schema-loose": "response_format json_schema with strict false (SGLang, Ollama, "
                         "servers that refuse strict)",
    "json-object": "response_format {type: json_object, schema: ...} (llama.cpp server, "
                   "llama-cpp-python)",
    "vllm": "vLLM >= 0.12 extra field structured_outputs: {json: schema}",
    "prompt": "no server constraint: the schema is put in the prompt; answers are validated "
              "and re-asked",
    "output-format": "Anthropic structured output (output_config.format json_schema)",
    "tool": "Anthropic tool use: one forced tool whose input schema is the answer schema",
}
OPENAI_FORMS = ("json-schema", "json-schema-loose", "json-object", "vllm", "prompt")
ANTHROPIC_FORMS = ("output-format", "tool", "prompt")


class Retryable(Exception):
    """A failure worth another attempt (429, 5xx, timeout, dropped connection). ``body`` is
    the server's own text (scrubbed), so a 500 that repeats the same body can be told from a
    transient one; ``kind`` is "http", "timeout", "refused" or "connection"."""

    def __init__(self, message: str, retry_after: float | None = None, *,
                 body: str | None = None, kind: str = "http", status: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.body = body
        self.kind = kind
        self.status = status


def _refused(exc: BaseException) -> bool:
    """A connection refused somewhere in the exception's cause chain (no server listening)."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, ConnectionRefusedError) or "refused" in str(cur).lower() \
                or "connect call failed" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def _dropped(exc: BaseException) -> bool:
    """The server closed the connection mid-request, which the SDKs' aiohttp transport reports
    as a connect "timeout": it is a dropped connection, not a call still running upstream."""
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return False
        if isinstance(cur, ConnectionResetError) or "server disconnected" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def parse_model_id(model: str) -> tuple[str, str]:
    provider, sep, name = model.partition("/")
    if not sep or not name or provider not in PROVIDERS:
        raise ModelSpecError(
            f"model {model!r}: write provider/model, provider one of {', '.join(PROVIDERS)} "
            "(e.g. openai/gpt-4.1, anthropic/claude-sonnet-4-5, replay/runs/demo/llm_calls.sqlite)")
    return provider, name


def _retry_after(headers: Any) -> float | None:
    if not headers:
        return None
    value = headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _split_system(messages: list[dict[str, str]]) -> tuple[str | None, list[dict[str, str]]]:
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    return system, [m for m in messages if m["role"] != "system"]


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """System instructions moved to the head of the first user message, for chat formats that
    drop the system role (Gemma's template, some llama.cpp chat formats)."""
    system, chat = _split_system(messages)
    if not system:
        return list(messages)
    chat = [dict(m) for m in chat]
    for m in chat:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            return chat
    return [{"role": "user", "content": system}] + chat


def schema_instruction(schema: dict[str, Any]) -> str:
    """For servers that constrain nothing: the schema, stated in the prompt."""
    return ("Reply with one JSON object only (no prose, no code fence) that matches this JSON "
            "schema:\n" + json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


def _with_instruction(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            m["content"] = f"{m['content']}\n\n{text}"
            return out
    return out + [{"role": "user", "content": text}]


_TLS: dict[tuple[str | None, str | None], Any] = {}


def tls_context() -> Any:
    """The SDKs' default TLS context (httpx's: its CA bundle, or ``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR``), made once per process for each value of those two variables. Loading
    the CA bundle takes ~30 ms: every client (every stage, every ``run``) paid it twice, for
    the SDK's transport and for the direct session, before its first call went out. A context
    is only read by connections, so one is shared by every client, loop and thread."""
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    ctx = _TLS.get(key)
    if ctx is None:
        import httpx2

        ctx = _TLS[key] = httpx2.create_ssl_context(verify=True, trust_env=True)
    return ctx


def _http_client(sdk: ModuleType, concurrency: int, timeout: float) -> Any:
    """One long-lived client per endpoint on the SDK's aiohttp transport, its pool sized to the
    concurrency (the SDK's own transport if the aiohttp extra is missing)."""
    import httpx2

    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    try:
        return sdk.DefaultAioHttpClient(limits=limits, timeout=timeout, verify=tls_context())
    except RuntimeError:
        return sdk.DefaultAsyncHttpxClient(limits=limits, timeout=timeout, verify=tls_context())


# How single calls reach an OpenAI-compatible server (``DRACO_LLM_TRANSPORT``): "direct" posts
# plain-HTTP URLs on draco's own HTTP/1.1 connections and TLS URLs on one aiohttp session of
# draco's own, "aiohttp" every URL on that session, "sdk" through the openai SDK's ``post``.
TRANSPORTS = ("direct", "aiohttp", "sdk")


def transport_setting() -> str:
    value = os.environ.get("DRACO_LLM_TRANSPORT", "").strip().lower() or "direct"
    if value not in TRANSPORTS:
        raise ModelSpecError(f"DRACO_LLM_TRANSPORT={value!r}: use one of {', '.join(TRANSPORTS)}")
    return value


class DirectPost:
    """Single calls posted by draco itself: to plain-HTTP URLs on its own HTTP/1.1 connections
    (``llm/http1.py``: a request written in the call's own step, ~0.07 ms of CPU a call), to
    the rest on one long-lived aiohttp session, its pool sized to the concurrency (both as
    ``_route`` decides). Why not the SDK: its own request path (typed options copied, an
    httpx request built and converted to aiohttp and back) cost more CPU per call than
    everything else draco does, and bounds the calls per second one event loop can keep in
    flight. It sends the headers the
    SDK client would (taken from it once: key, organisation, version headers), with the same
    timeouts and TLS context as the SDK's aiohttp transport (a URL behind a proxy stays on the
    SDK path: ``_env_proxy``), and maps every failure to the same ``Retryable`` /
    ``RequestRejected`` as the SDK path (``_mapped``)."""

    def __init__(self, headers: dict[str, str], concurrency: int, timeout: float,
                 http1: bool = True) -> None:
        self.headers = headers
        self.concurrency = concurrency
        self.timeout_s = timeout
        self.http1 = http1   # plain-HTTP URLs on draco's own connections (``llm/http1.py``)
        from draco_cli.llm.http1 import check_headers

        try:
            check_headers(headers)
        except ValueError as exc:   # e.g. a key pasted with its line break
            raise ModelSpecError(f"{exc}: check OPENAI_API_KEY and the OPENAI_ settings") \
                from None
        self._session: Any = None
        self._pools: dict[tuple[str, int], Http1Pool] = {}
        self._routes: dict[str, tuple[Http1Pool, str] | None] = {}

    @staticmethod
    def _keepalive_expiry() -> float:
        """The SDK's pool's idle expiry, kept by both of draco's routes."""
        import httpx2

        return httpx2.Limits().keepalive_expiry or 5.0

    def _open(self) -> Any:
        import aiohttp

        # as the SDK's transport: httpx's TLS context (its CA bundle, SSL_CERT_FILE), its
        # keep-alive expiry, a timeout per connect and per read rather than for the whole call
        connector = aiohttp.TCPConnector(
            limit=self.concurrency, keepalive_timeout=self._keepalive_expiry(),
            ssl=tls_context())
        self.timeout = aiohttp.ClientTimeout(sock_connect=self.timeout_s,
                                             sock_read=self.timeout_s, connect=self.timeout_s)
        # trust_env off, as the SDK's own aiohttp session: it would look up netrc and proxy
        # settings in a worker thread on every request (a URL behind a proxy from the
        # environment is never sent this way: ``_env_proxy``)
        self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def post(self, url: str, data: bytes,
                   label: str) -> tuple[dict[str, Any], float, str | None]:
        """POST ``data`` (JSON bytes); return (JSON reply, latency, the reply as text when it
        is UTF-8: logged as received instead of encoded again)."""
        try:
            route = self._routes[url]
        except KeyError:
            route = self._routes[url] = self._route(url)
        if route is not None:
            return await self._post_http1(route[0], route[1], data, label)
        import aiohttp

        session = self._session or self._open()
        start = time.perf_counter()
        try:
            async with session.post(url, data=data, headers=self.headers, timeout=self.timeout,
                                    allow_redirects=False) as resp:
                raw = await resp.read()
                status, headers = resp.status, resp.headers
                # only an error body is decoded by its charset: Content-Type is parsed (a
                # few µs in aiohttp) only then
                charset = None if 200 <= status < 300 else resp.charset
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise _transport_failure(exc) from None
        except aiohttp.ClientPayloadError:
            raise Retryable("connection error (ReadError)", kind="connection") from None
        except aiohttp.ClientError as exc:
            raise Retryable(f"connection error ({type(exc).__name__})",
                            kind="connection") from None
        return _reply(status, headers, raw, charset, time.perf_counter() - start, label)

    def _route(self, url: str) -> tuple[Http1Pool, str] | None:
        """The connection pool and request target for ``url`` when draco's own HTTP/1.1
        client takes it: plain HTTP with no credentials in the URL; anything else is aiohttp's."""
        from urllib.parse import quote, urlsplit

        from draco_cli.llm.http1 import Http1Pool

        parts = urlsplit(url)
        if not self.http1 or parts.scheme != "http" or not parts.hostname \
                or parts.username is not None or parts.password is not None:
            return None
        host, port = parts.hostname, parts.port or 80
        if not host.isascii():
            host = host.encode("idna").decode("ascii")
        target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
        if parts.query:
            target += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[(host, port)] = Http1Pool(
                host, port, self.headers, limit=self.concurrency,
                keepalive_expiry=self._keepalive_expiry(),
                connect_timeout=self.timeout_s, read_timeout=self.timeout_s)
        return pool, target

    async def _post_http1(self, pool: Http1Pool, target: str, data: bytes,
                          label: str) -> tuple[dict[str, Any], float, str | None]:
        from draco_cli.llm.http1 import MalformedReply, TruncatedReply
        from draco_cli.llm.keys import scrub

        start = time.perf_counter()
        try:
            resp = await pool.post(target, data)
        except (TimeoutError, asyncio.TimeoutError) as exc:   # before OSError: the first is one
            raise _transport_failure(exc) from None
        except OSError as exc:   # refused, dropped, or no route to the server
            if _refused(exc) or _dropped(exc):
                raise _transport_failure(exc) from None
            raise Retryable(f"connection error ({type(exc).__name__})",
                            kind="connection") from None
        except TruncatedReply:
            raise Retryable("connection error (ReadError)", kind="connection") from None
        except MalformedReply as exc:   # the server's own bytes: scrubbed, bounded
            raise Retryable(f"connection error (not an HTTP reply: {scrub(str(exc)[:200])})",
                            kind="connection") from None
        status = resp.status
        charset = None if 200 <= status < 300 else _charset(resp.headers.get("content-type"))
        return _reply(status, resp.headers, resp.body, charset, time.perf_counter() - start,
                      label)

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.close()
        self._pools.clear()
        self._routes.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None


def _charset(content_type: str | None) -> str | None:
    """The charset parameter of a Content-Type, as aiohttp's ``charset`` reads it."""
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"') or None
    return None


def _reply(status: int, headers: Any, raw: bytes, charset: str | None, latency: float,
           label: str) -> tuple[dict[str, Any], float, str | None]:
    """A reply's JSON (and its text, logged as received) or the failure its status means."""
    if not 200 <= status < 300:
        body, message = _sdk_error(status, raw, charset)
        raise _status_failure(status, body, message, headers, label,
                              busy=status == 429 or status >= 500)
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


def _env_proxy(url: str) -> str | None:
    """The proxy the environment (HTTPS_PROXY, NO_PROXY ...) names for ``url``, if any: the
    SDK's httpx client routes through it, so such calls keep to the SDK path."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(url)
    proxy = getproxies().get(parts.scheme) or getproxies().get("all")
    if not proxy or (parts.hostname and proxy_bypass(parts.hostname)):
        return None
    return proxy


def _direct_headers(client: Any, timeout: float) -> dict[str, str] | None:
    """The headers the SDK client sends with every request, or None when its authentication
    is more than a static key (workload identity, a key provider, a token cache): those calls
    stay on the SDK path, which knows how to refresh them."""
    auth = dict(client.auth_headers)
    if not auth or client.custom_auth is not None or getattr(client, "_api_key_provider", None):
        return None
    headers = {k: v for k, v in client.default_headers.items() if isinstance(v, str)}  # no Omit
    headers.update(auth)
    headers["x-stainless-retry-count"] = "0"
    headers["x-stainless-read-timeout"] = str(float(timeout))
    return headers


# Status codes worth another attempt besides 429 and 5xx (529 = Anthropic "overloaded").
RETRY_STATUS = (408, 409, 425, 529)


def _body_text(body: object) -> str:
    """The server's error body as text (scrubbed, bounded), for the terminal and the log."""
    from draco_cli.llm.keys import scrub

    if body is None:
        return ""
    text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return scrub(text[:1000]) or ""


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


def _status_failure(status: int, body: object, message: str, headers: Any, label: str,
                    busy: bool) -> Exception:
    """What an HTTP error status means to the client, whichever transport got it: ``busy``
    (429, 5xx) and the other retry statuses are ``Retryable``; anything else is the server
    rejecting the request itself (``RequestRejected``, its reason in the message). ``body``
    and ``message`` are as the SDKs make them (the ``error`` object or the text; "Error code:
    N - reason")."""
    text = _body_text(body)
    if busy:
        return Retryable(f"HTTP {status}" + (f": {_brief(body, message)}" if text else ""),
                         _retry_after(headers), body=text, status=status)
    if status in RETRY_STATUS:
        return Retryable(f"HTTP {status}", _retry_after(headers), body=text, status=status)
    # A request the server rejects as malformed is not retried: its reason is the message.
    return RequestRejected(f"{label}: HTTP {status}: {_brief(body, message)}", body=text,
                           status=status)


def _transport_failure(exc: BaseException) -> Retryable:
    """A call that got no HTTP reply: refused, dropped, or timed out. The SDKs' aiohttp
    transport reports all three as a connect "timeout", so they are told apart by the cause."""
    if _refused(exc):
        return Retryable("connection refused (is the server running?)", kind="refused")
    if _dropped(exc):
        return Retryable("connection dropped by the server", kind="connection")
    return Retryable("timeout (no reply within --timeout)", kind="timeout")


T = TypeVar("T")


async def _mapped(sdk: ModuleType, label: str, call: Callable[[], Awaitable[T]]) -> T:
    """Await ``call()`` with the SDK's typed errors mapped once, for single calls and batch
    operations alike: failures worth retrying become ``Retryable``, a request the server
    rejects ``RequestRejected`` (its reason in the message). Both SDKs name them alike."""
    try:
        return await call()
    except (sdk.RateLimitError, sdk.InternalServerError) as exc:
        raise _status_failure(exc.status_code, _sdk_body(exc), str(exc.message),
                              exc.response.headers, label, busy=True) from None
    except sdk.APITimeoutError as exc:
        raise _transport_failure(exc) from None
    except sdk.APIConnectionError as exc:
        if _refused(exc):
            raise Retryable("connection refused (is the server running?)",
                            kind="refused") from None
        raise Retryable(f"connection error ({type(exc.__cause__).__name__})",
                        kind="connection") from None
    except sdk.APIStatusError as exc:
        raise _status_failure(exc.status_code, _sdk_body(exc), str(exc.message),
                              exc.response.headers, label, busy=False) from None


def _json_of(raw: Any) -> dict[str, Any]:
    try:
        data: dict[str, Any] = raw.json()
        return data
    except ValueError:
        raise Retryable("the server sent a body that is not JSON") from None


async def _post_json(sdk: ModuleType, client: Any, path: str, body: dict[str, Any] | bytes,
                     label: str) -> tuple[dict[str, Any], float]:
    """POST through the SDK's public low-level ``post`` (its transport, auth and typed errors,
    without re-walking the request through typed params and the reply through pydantic, which
    cost more CPU than everything else per call at high concurrency). A body already serialised
    (bytes) is sent as it is. Returns (JSON reply, latency)."""
    import httpx2

    sent = {"content": body} if isinstance(body, bytes) else {"body": body}
    start = time.perf_counter()
    raw = await _mapped(sdk, label, lambda: client.post(path, cast_to=httpx2.Response, **sent))
    latency = time.perf_counter() - start
    return _json_of(raw), latency


async def _get_json(sdk: ModuleType, client: Any, path: str, label: str) -> dict[str, Any]:
    import httpx2

    return _json_of(await _mapped(sdk, label, lambda: client.get(path, cast_to=httpx2.Response)))


async def _get_text(sdk: ModuleType, client: Any, path: str, label: str,
                    accept: str | None = None) -> str:
    import httpx2

    options = {"headers": {"Accept": accept}} if accept else {}

    async def call() -> str:
        raw = await client.get(path, cast_to=httpx2.Response, options=options)
        text: str = raw.text
        return text

    return await _mapped(sdk, label, call)


def _jsonl(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                raise Retryable("a batch result file with a line that is not JSON") from None
    return out


@dataclass
class BatchState:
    """Where a submitted batch stands: ``ended`` once nothing more will be answered."""

    batch_id: str
    status: str
    ended: bool
    counts: dict[str, int] = field(default_factory=dict)


class RequestRejected(LLMError):
    """The server refused the request itself (a 4xx, or a 500 repeating the same body): sending
    it again cannot help. ``body`` is the server's reply, kept in the call log."""

    def __init__(self, message: str, *, body: str | None = None, status: int | None = None):
        super().__init__(message)
        self.body = body
        self.status = status


class Provider(abc.ABC):
    """What the client needs from an API: build a body, make one call, close. Subclasses are
    registered by ``provider/`` prefix in ``REGISTRY``; batch APIs are optional methods."""

    name = "provider"
    supports_n = False
    forms: tuple[str, ...] = ()
    default_form = "prompt"

    def __init__(self, model: str, *, base_url: str | None = None, concurrency: int = 16,
                 timeout: float = 120.0, structured_output: str | None = None,
                 system_role: bool = True, use_n: bool = True) -> None:
        """Every provider is made with these (``make_provider``) and uses those its API has."""
        self.model = model

    def _form(self, form: str | None) -> str:
        form = form or "auto"
        if form == "auto":
            return self.default_form
        if form not in self.forms:
            raise ModelSpecError(f"--structured-output {form}: {self.name}/ models take "
                                 f"{', '.join(('auto',) + self.forms)}")
        return form

    @abc.abstractmethod
    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        """One HTTP call for ``samples`` of ``req``."""

    async def close(self) -> None:
        return None

    # -- batch APIs (optional): each method is one HTTP exchange, its errors mapped like a
    # single call's (``Retryable`` / ``RequestRejected``), so the caller retries them alike.

    offers_batch = False  # the protocol has a batch API (a given server may still lack it)

    def batch_request(self, req: LLMRequest, samples: list[int]) -> dict[str, Any]:
        """The body one batch line sends for ``samples`` of ``req``."""
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")

    async def submit_batch(self, lines: dict[str, dict[str, Any]]) -> str:
        """Submit ``custom_id -> body``; return the batch id."""
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")

    async def poll_batch(self, batch_id: str) -> BatchState:
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")

    async def batch_results(self, batch_id: str) -> dict[str, Reply]:
        """``custom_id -> reply`` for every line the batch answered (errored, expired or
        cancelled lines are absent)."""
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")


class OpenAIProvider(Provider):
    """OpenAI's API, or any OpenAI-compatible server (vLLM, SGLang, Ollama, llama.cpp)."""

    name = "openai"
    supports_n = True
    forms = OPENAI_FORMS
    default_form = "json-schema"

    def __init__(self, model: str, *, base_url: str | None, concurrency: int, timeout: float,
                 structured_output: str | None = None, system_role: bool = True,
                 use_n: bool = True):
        try:
            import openai
        except ImportError:  # pragma: no cover - declared dependency
            raise ModelSpecError("openai/ models need the 'openai' package") from None
        self._openai = openai
        self.model = model
        self.self_hosted = base_url is not None
        self.form = self._form(structured_output)
        self.system_role = system_role
        self.supports_n = use_n
        api_key = None
        if not os.environ.get("OPENAI_API_KEY"):
            if not self.self_hosted:
                raise LLMError(f"openai/{model}: OPENAI_API_KEY is not set (or use --base-url "
                               "for a self-hosted server, which needs no key)")
            api_key = "none"  # local servers take any key; the SDK insists on one
        http = _http_client(openai, concurrency, timeout)
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                         timeout=timeout, http_client=http)
        # absolute, so the SDK does not parse and merge the base URL again on every call
        self._chat_url = f"{self.client.base_url}chat/completions"
        # single calls: draco's own session unless told otherwise or the key is not static
        transport = transport_setting()
        headers = _direct_headers(self.client, timeout) \
            if transport != "sdk" and not _env_proxy(self._chat_url) else None
        self.direct = DirectPost(headers, concurrency, timeout, http1=transport == "direct") \
            if headers is not None else None
        self._rest_json: dict[Any, str] = {}   # see ``wire``

    def _response_format(self, req: LLMRequest) -> dict[str, Any]:
        schema = req.schema()
        if self.form in ("json-schema", "json-schema-loose"):
            return {"response_format": {"type": "json_schema", "json_schema": {
                "name": req.schema_name, "schema": schema,
                "strict": self.form == "json-schema"}}}
        if self.form == "json-object":
            return {"response_format": {"type": "json_object", "schema": schema}}
        if self.form == "vllm":
            return {"extra_body": {"structured_outputs": {"json": schema}}}
        return {}

    def body(self, req: LLMRequest, messages: list[dict[str, str]], n: int) -> dict[str, Any]:
        s = req.sampling
        if self.form == "prompt":
            messages = _with_instruction(messages, schema_instruction(req.schema()))
        if not self.system_role:
            messages = fold_system(messages)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        extra = self._response_format(req)
        body.update({k: v for k, v in extra.items() if k != "extra_body"})
        # Self-hosted servers take max_tokens; OpenAI's own reasoning models need the newer name.
        body["max_tokens" if self.self_hosted else "max_completion_tokens"] = s.max_tokens
        if n > 1:
            body["n"] = n
        for k in ("temperature", "top_p", "seed"):
            if getattr(s, k) is not None:
                body[k] = getattr(s, k)
        if self.self_hosted:
            # Qwen3-style templates switch thinking with a template argument (vLLM, SGLang).
            body["extra_body"] = {"chat_template_kwargs": {"enable_thinking": s.thinking}}
        elif s.thinking:
            body["reasoning_effort"] = "medium"
        if "extra_body" in extra:
            body.setdefault("extra_body", {}).update(extra["extra_body"])
        return body

    def wire(self, req: LLMRequest, messages: list[dict[str, str]],
             n: int) -> tuple[dict[str, Any], str]:
        """The body of one call and its JSON as sent. Everything but the messages is the same
        for every request of a phase with the model's own schema: its JSON is made once."""
        body = self.body(req, messages, n)
        wire = dict(body)
        wire.update(wire.pop("extra_body", {}))
        # repr(sampling) tells 1 from 1.0 and 0.0 from -0.0, which compare equal; a request's
        # own schema counts as the model's when it carries a key for it (``schema_key``)
        schema: Any = req.answer_model if req.json_schema is None else \
            None if req.schema_key is None else ("schema_key", req.schema_key)
        key = (schema, req.schema_name, n, repr(req.sampling)) if schema is not None else None
        return wire, wire_json(wire, req, self._rest_json if key is not None else None, key)

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        wire, text = self.wire(req, messages, len(samples))
        label = f"openai/{self.model}"
        received = None
        if self.direct is not None:
            data, latency, received = await self.direct.post(self._chat_url, text.encode(),
                                                             label)
        else:  # sent as bytes: the SDK neither copies nor encodes the body again
            data, latency = await _post_json(self._openai, self.client, self._chat_url,
                                             text.encode(), label)
        if not isinstance(data, dict):
            raise Retryable("the server sent JSON that is not a chat completion object")
        reply = openai_reply(data, wire)
        reply.latency_s = latency
        reply.request_text = text
        reply.response_text = received
        return reply

    async def close(self) -> None:
        if self.direct is not None:
            await self.direct.close()
        await self.client.close()

    # -- OpenAI Batch: a JSONL file of /v1/chat/completions bodies, one output file ----------

    offers_batch = True
    BATCH_ENDED = ("completed", "failed", "expired", "cancelled")

    def _label(self, what: str) -> str:
        return f"openai/{self.model}: {what}"

    def batch_request(self, req: LLMRequest, samples: list[int]) -> dict[str, Any]:
        body = self.body(req, req.messages, len(samples))
        body.update(body.pop("extra_body", {}))  # SDK-only key: in a batch file it is the body
        return body

    async def submit_batch(self, lines: dict[str, dict[str, Any]]) -> str:
        payload = "".join(json.dumps({"custom_id": cid, "method": "POST",
                                      "url": "/v1/chat/completions", "body": body}) + "\n"
                          for cid, body in lines.items()).encode()
        sdk, label = self._openai, self._label("uploading the batch file")
        f = await _mapped(sdk, label, lambda: self.client.files.create(
            file=("draco-batch.jsonl", payload), purpose="batch"))
        batch, _ = await _post_json(sdk, self.client, "/batches", {
            "input_file_id": f.id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}, self._label("creating the batch"))
        return str(batch["id"])

    async def poll_batch(self, batch_id: str) -> BatchState:
        b = await _get_json(self._openai, self.client, f"/batches/{batch_id}",
                            self._label(f"polling batch {batch_id}"))
        status = b.get("status") or "unknown"
        return BatchState(batch_id, status, status in self.BATCH_ENDED,
                          dict(b.get("request_counts") or {}))

    async def batch_results(self, batch_id: str) -> dict[str, Reply]:
        b = await _get_json(self._openai, self.client, f"/batches/{batch_id}",
                            self._label(f"reading batch {batch_id}"))
        if not b.get("output_file_id"):
            return {}  # failed, expired or cancelled before any line was answered
        text = await _get_text(self._openai, self.client, f"/files/{b['output_file_id']}/content",
                               self._label(f"reading the results of batch {batch_id}"))
        out = {}
        for item in _jsonl(text):
            resp = item.get("response") or {}
            if resp.get("status_code") == 200 and item.get("custom_id"):
                out[item["custom_id"]] = openai_reply(resp["body"], {}, batch_id)
        return out


# json.dumps with arguments builds an encoder per call; this one is built once (same output)
_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def wire_json(wire: dict[str, Any], req: LLMRequest, cache: dict[Any, str] | None = None,
              key: Any = None) -> str:
    """The request body as JSON, serialised once: the request's messages, when sent as they
    are, are spliced in from the JSON its cache key already hashed. ``cache[key]`` holds the
    JSON of the rest when a caller knows what determines it."""
    if wire.get("messages") is not req.messages:
        return _compact(wire)
    rest = cache.get(key) if cache is not None else None
    if rest is None:
        rest = _compact({k: v for k, v in wire.items() if k != "messages"})
        if cache is not None:
            if len(cache) > 1024:
                cache.clear()
            cache[key] = rest
    return (rest[:-1] + ("," if len(wire) > 1 else "") + '"messages":' + req.messages_json()
            + "}")


class AnthropicProvider(Provider):
    """Anthropic's Messages API with structured output (``output_config.format``) or a forced
    tool whose input schema is the answer schema."""

    name = "anthropic"
    supports_n = False
    forms = ANTHROPIC_FORMS
    default_form = "output-format"

    def __init__(self, model: str, *, base_url: str | None, concurrency: int, timeout: float,
                 structured_output: str | None = None, system_role: bool = True,
                 use_n: bool = False):
        try:
            import anthropic
        except ImportError:  # pragma: no cover - declared dependency
            raise ModelSpecError("anthropic/ models need the 'anthropic' package") from None
        self._anthropic = anthropic
        self.model = model
        self.form = self._form(structured_output)
        self.system_role = system_role
        api_key = None
        if not (os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")):
            if base_url is None:
                raise LLMError(f"anthropic/{model}: ANTHROPIC_API_KEY is not set")
            api_key = "none"  # a local or proxy endpoint; the SDK insists on some key
        http = _http_client(anthropic, concurrency, timeout)
        self.client = anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0,
                                               timeout=timeout, http_client=http)

    def body(self, req: LLMRequest, messages: list[dict[str, str]], n: int = 1) -> dict[str, Any]:
        s = req.sampling
        if self.form == "prompt":
            messages = _with_instruction(messages, schema_instruction(req.schema()))
        if not self.system_role:
            messages = fold_system(messages)
        system, chat = _split_system(messages)
        body: dict[str, Any] = {"model": self.model, "max_tokens": s.max_tokens,
                                "messages": chat}
        if self.form == "output-format":
            body["output_config"] = {"format": {"type": "json_schema", "schema": req.schema()}}
        elif self.form == "tool":
            body["tools"] = [{"name": req.schema_name, "input_schema": req.schema(),
                              "description": "Record the answer."}]
            body["tool_choice"] = {"type": "tool", "name": req.schema_name}
        if system:
            # Prompt caching: the instructions are the prefix every call of a phase shares.
            body["system"] = [{"type": "text", "text": system,
                               "cache_control": {"type": "ephemeral"}}]
        if req.samples > 1 and chat and isinstance(chat[-1].get("content"), str):
            # k samples are k calls with one prompt (no n on Anthropic): cache all of it.
            marked: list[dict[str, Any]] = [dict(m) for m in chat]
            marked[-1]["content"] = [{"type": "text", "text": chat[-1]["content"],
                                      "cache_control": {"type": "ephemeral"}}]
            body["messages"] = marked
        if s.thinking:
            # Thinking tokens count toward max_tokens; leave room for the answer.
            body["thinking"] = {"type": "enabled",
                                "budget_tokens": max(1024, min(s.max_tokens // 2, 16000))}
        elif s.temperature is not None:
            body["temperature"] = s.temperature  # not allowed together with thinking
        if s.top_p is not None and not s.thinking:
            body["top_p"] = s.top_p
        return body

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        if len(samples) != 1:
            raise ValueError("Anthropic answers one sample per call")
        body = self.body(req, messages)
        message, latency = await _post_json(self._anthropic, self.client, "/v1/messages", body,
                                            f"anthropic/{self.model}")
        return Reply([anthropic_choice(message)], anthropic_usage(message.get("usage") or {}),
                     body, message, latency)

    async def close(self) -> None:
        await self.client.close()

    # -- Anthropic Message Batches: one line per sample (no n), results as JSONL ------------

    offers_batch = True

    def _label(self, what: str) -> str:
        return f"anthropic/{self.model}: {what}"

    def batch_request(self, req: LLMRequest, samples: list[int]) -> dict[str, Any]:
        if len(samples) != 1:
            raise ValueError("Anthropic answers one sample per batch line")
        return self.body(req, req.messages)

    async def submit_batch(self, lines: dict[str, dict[str, Any]]) -> str:
        batch, _ = await _post_json(
            self._anthropic, self.client, "/v1/messages/batches",
            {"requests": [{"custom_id": cid, "params": body} for cid, body in lines.items()]},
            self._label("creating the batch"))
        return str(batch["id"])

    async def poll_batch(self, batch_id: str) -> BatchState:
        b = await _get_json(self._anthropic, self.client, f"/v1/messages/batches/{batch_id}",
                            self._label(f"polling batch {batch_id}"))
        status = b.get("processing_status") or "unknown"
        return BatchState(batch_id, status, status == "ended",
                          dict(b.get("request_counts") or {}))

    async def batch_results(self, batch_id: str) -> dict[str, Reply]:
        b = await _get_json(self._anthropic, self.client, f"/v1/messages/batches/{batch_id}",
                            self._label(f"reading batch {batch_id}"))
        url = b.get("results_url") or f"/v1/messages/batches/{batch_id}/results"
        text = await _get_text(self._anthropic, self.client, url,
                               self._label(f"reading the results of batch {batch_id}"),
                               accept="application/binary")
        out = {}
        for entry in _jsonl(text):
            result = entry.get("result") or {}
            if result.get("type") == "succeeded" and entry.get("custom_id"):
                message = result["message"]
                out[entry["custom_id"]] = Reply(
                    [anthropic_choice(message)], anthropic_usage(message.get("usage") or {}),
                    {}, message, 0.0, batch_id)
        return out


def openai_reply(body: dict[str, Any], request_body: dict[str, Any],
                 batch_id: str | None = None) -> Reply:
    """A chat-completion JSON body (online or from a batch file) as a Reply."""
    choices = []
    for c in sorted(body.get("choices") or [], key=lambda c: c.get("index", 0)):
        msg = c.get("message") or {}
        refusal = msg.get("refusal")
        choices.append(Choice(text=msg.get("content"),
                              finish="refusal" if refusal else c.get("finish_reason") or "stop",
                              refusal=refusal))
    u = body.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    # OpenAI's prompt_tokens include the cached ones; completion_tokens include reasoning.
    usage = Usage(input_tokens=(u.get("prompt_tokens") or 0) - cached, cached_tokens=cached,
                  output_tokens=u.get("completion_tokens") or 0,
                  reasoning_tokens=(u.get("completion_tokens_details") or {})
                  .get("reasoning_tokens") or 0)
    return Reply(choices, usage, request_body, body, 0.0, batch_id)


def anthropic_choice(message: dict[str, Any]) -> Choice:
    blocks = message.get("content") or []
    tool = next((b for b in blocks if b.get("type") == "tool_use"), None)
    if tool is not None:  # the tool form: the answer is the forced tool's input
        stop = message.get("stop_reason")
        return Choice(text=json.dumps(tool.get("input"), ensure_ascii=False),
                      finish="length" if stop == "max_tokens" else "stop")
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text") or None
    stop = message.get("stop_reason")
    finish = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
              "refusal": "refusal"}.get(stop or "", stop or "stop")
    return Choice(text=text, finish=finish, refusal=text if finish == "refusal" else None)


def anthropic_usage(u: dict[str, Any]) -> Usage:
    # Anthropic's input_tokens exclude cache reads and cache writes.
    details = u.get("output_tokens_details") or {}
    return Usage(input_tokens=u.get("input_tokens") or 0,
                 cached_tokens=u.get("cache_read_input_tokens") or 0,
                 cache_write_tokens=u.get("cache_creation_input_tokens") or 0,
                 output_tokens=u.get("output_tokens") or 0,
                 reasoning_tokens=details.get("thinking_tokens") or 0)


class ReplayProvider(Provider):
    """Answers only from a recorded call log; anything else is an error (offline demos, tests)."""

    name = "replay"
    supports_n = True

    def __init__(self, path: str, **_: Any) -> None:
        from draco_cli.llm.calllog import ReplayLog

        self.model = path
        self.log = ReplayLog(path)

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        choices = []
        for i in samples:
            hit = self.log.answers.get((req.hash(i, None), i))
            if hit is None:
                raise ReplayMiss(
                    f"replay/{self.model}: no recorded answer for this {req.phase} request "
                    f"(key {req.key!r}, sample {i}): the recorded run asked fewer samples, or "
                    "its prompt, schema, sampling or template version differ from this one")
            choices.append(Choice(text=hit.answer_text, finish="stop"))
        return Reply(choices, Usage(), {"replay": True}, {"replay": True}, 0.0)

    async def close(self) -> None:
        return None


REGISTRY: dict[str, type[Provider]] = {"openai": OpenAIProvider,
                                       "anthropic": AnthropicProvider,
                                       "replay": ReplayProvider}


def make_provider(model: str, *, base_url: str | None = None, concurrency: int = 16,
                  timeout: float = 120.0, structured_output: str | None = None,
                  system_role: bool = True, use_n: bool = True) -> Provider:
    provider, name = parse_model_id(model)
    base_url = base_url or os.environ.get("DRACO_BASE_URL")
    cls = REGISTRY[provider]
    if cls is ReplayProvider:
        return ReplayProvider(name)
    return cls(name, base_url=base_url, concurrency=concurrency, timeout=timeout,
               structured_output=structured_output, system_role=system_role, use_n=use_n)


def _brief(body: object, message: str) -> str:
    """The server's error message, without any key it may quote back."""
    from draco_cli.llm.keys import scrub

    text = message
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
    # One line: servers put tracebacks and pretty-printed validation errors in their bodies.
    return scrub(" ".join(text.split())[:300]) or ""
