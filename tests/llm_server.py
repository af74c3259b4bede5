"""A local HTTP server that speaks enough of the OpenAI (chat completions with n, files and
batches) and Anthropic (messages, message batches) protocols for the real SDK clients to talk
to it. It serves scripted answers and injects faults on demand. Loopback by default.

With ``schema_answer`` it answers every request with a minimal instance of the request's own
JSON schema (as the in-process ``mock/`` provider does), so `llm check`, `rubric generate`,
`judge score` and `draco run` work offline against it. ``python -m tests.llm_server --port N``
serves it from another process (benchmarks)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from draco_cli.llm.providers.mock import instance


def default_answer(body: dict[str, Any], index: int) -> str:
    return json.dumps({"verdict": "pass" if index % 2 == 0 else "fail", "steps": [1 + index],
                       "reason": f"sample {index}"})


def _schema_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The answer schema a request carries, in whichever form it was sent (None when it
    carries none, or one that is not a JSON object)."""
    found = _sent_schema(body)
    return found if isinstance(found, dict) else None


def _sent_schema(body: dict[str, Any]) -> Any:
    found = _wire_schema(body)
    if found is not None:
        return found
    marker = "matches this JSON schema:\n"
    for m in reversed(body.get("messages") or []):
        content = "".join(text for text, _ in _text_of(m.get("content")))
        if marker in content:  # the prompt form: schema at the end
            try:
                return json.loads(content.rsplit(marker, 1)[1])
            except ValueError:
                return None
    return None


def _wire_schema(body: dict[str, Any]) -> Any:
    """The schema a request sends beside its messages (the prompt form sends none: its
    schema is part of the messages, and is cached as their text)."""
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":
        return (rf.get("json_schema") or {}).get("schema")
    if rf.get("type") == "json_object" and rf.get("schema"):
        return rf["schema"]
    if isinstance(body.get("structured_outputs"), dict):
        return body["structured_outputs"].get("json")
    fmt = (body.get("output_config") or {}).get("format") or {}
    if fmt.get("schema"):
        return fmt["schema"]
    for tool in body.get("tools") or []:
        if tool.get("input_schema"):
            return tool["input_schema"]
    return None


def schema_answer(body: dict[str, Any], index: int) -> str:
    """Answer any request with a minimal instance of its own schema (``{}`` without one)."""
    schema = _schema_of(body)
    return json.dumps(instance(schema, index) if schema else {})


_TOKEN = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> list[str]:
    """The mock's tokenizer: a word or a punctuation mark is one token (real tokenizers give
    the same order of magnitude on English and JSON)."""
    return _TOKEN.findall(text)


class PrefixCache:
    """Prompt caching as the providers account it, over the mock's tokens.

    OpenAI (automatic): a prompt of at least 1024 tokens is cached by prefix; a later prompt
    sharing a prefix reads the longest cached one, in steps of 128 tokens past the first 1024
    (1024, 1152, ...); ``cached_tokens`` are part of ``prompt_tokens``; writing costs nothing.

    Anthropic (``cache_control``): the prefix up to each marked block is a cache entry once it
    is at least the model's minimum (1024 tokens for Sonnet/Opus); a request reads the longest
    marked prefix already cached (``cache_read_input_tokens``), writes the part between that
    and its last marked block (``cache_creation_input_tokens``), and pays ``input_tokens`` for
    the rest (input_tokens exclude both). Entries live as long as the server (real caches
    expire after 5 minutes unused; a run's calls come closer together than that)."""

    def __init__(self, minimum: int = 1024, step: int = 128) -> None:
        self.minimum, self.step = minimum, step
        self.seen: set[str] = set()

    @staticmethod
    def _hashes(tokens: list[str], cuts: list[int]) -> dict[int, str]:
        h, at, out = hashlib.sha1(), 0, {}
        for cut in sorted(set(cuts)):
            h.update("\x00".join(tokens[at:cut]).encode() + b"\x01")
            at = cut
            out[cut] = h.copy().hexdigest()
        return out

    def openai(self, tokens: list[str]) -> int:
        """Cached tokens of this prompt; the prompt's prefixes are cached for later ones."""
        hit, new = self.openai_lookup(tokens)
        self.seen.update(new)
        return hit

    def openai_lookup(self, tokens: list[str]) -> tuple[int, set[str]]:
        """(cached tokens, the entries this prompt leaves once its prefill is done)."""
        if len(tokens) < self.minimum:
            return 0, set()
        cuts = list(range(self.minimum, len(tokens) + 1, self.step))
        hashes = self._hashes(tokens, cuts)
        return max((c for c in cuts if hashes[c] in self.seen), default=0), set(hashes.values())

    def anthropic(self, tokens: list[str], marks: list[int]) -> tuple[int, int]:
        """(cache read, cache write) tokens for a prompt with cache_control marks ending at
        ``marks`` (token positions)."""
        read, write, new = self.anthropic_lookup(tokens, marks)
        self.seen.update(new)
        return read, write

    def anthropic_lookup(self, tokens: list[str], marks: list[int]
                         ) -> tuple[int, int, set[str]]:
        marks = [m for m in marks if m >= self.minimum]
        if not marks:
            return 0, 0, set()
        hashes = self._hashes(tokens, marks)
        read = max((m for m in marks if hashes[m] in self.seen), default=0)
        return read, max(marks) - read, set(hashes.values())


def _text_of(content: Any) -> list[tuple[str, bool]]:
    """(text, cache_control marked) per block of an Anthropic content field."""
    if isinstance(content, str):
        return [(content, False)]
    out: list[tuple[str, bool]] = []
    for b in content or []:
        text = b.get("text") if b.get("type") == "text" else json.dumps(b, sort_keys=True)
        out.append((text or "", bool(b.get("cache_control"))))
    return out


def openai_prompt(body: dict[str, Any]) -> list[str]:
    """The prompt's tokens in the order they are cached: the answer schema (a stable part of
    the prefix), then the messages."""
    schema = _wire_schema(body)
    head = json.dumps(schema, sort_keys=True) if isinstance(schema, dict) else ""
    parts = [head] + [f"{m.get('role')}: {json.dumps(m.get('content'))}"
                      for m in body.get("messages") or []]
    return count_tokens("\n".join(parts))


def anthropic_prompt(body: dict[str, Any]) -> tuple[list[str], list[int]]:
    """Tokens in Anthropic's cache order (tools, system, messages) and the positions where a
    block with cache_control ends."""
    blocks: list[tuple[str, bool]] = []
    for tool in body.get("tools") or []:
        blocks.append((json.dumps(tool, sort_keys=True), bool(tool.get("cache_control"))))
    fmt = (body.get("output_config") or {}).get("format")
    if fmt:
        blocks.append((json.dumps(fmt, sort_keys=True), False))
    blocks += _text_of(body.get("system"))
    for m in body.get("messages") or []:
        blocks.append((f"{m.get('role')}:", False))
        blocks += _text_of(m.get("content"))
    tokens: list[str] = []
    marks: list[int] = []
    for text, marked in blocks:
        tokens += count_tokens(text)
        if marked:
            marks.append(len(tokens))
    return tokens, marks


# Makes the text of choice ``index`` for a request body.
Answerer = Callable[[dict[str, Any], int], str]
# An injected fault: its kind and options (``push``, ``push_batch``).
Fault = tuple[str, dict[str, Any]]


class FakeLLMServer:
    def __init__(self, answer: Answerer = default_answer, latency: float = 0.0,
                 prompt_tokens: int = 100, cached_tokens: int = 20, completion_tokens: int = 10,
                 reasoning_tokens: int = 0, caching: bool = False, cache_minimum: int = 1024,
                 batch_polls: int = 2) -> None:
        # caching=False: every call reports the fixed token counts given; True: tokens are
        # counted from the request and the answer, cached tokens as each provider's cache
        # accounts them (PrefixCache).
        self.caching = caching
        self.openai_cache = PrefixCache(cache_minimum)
        self.anthropic_cache = PrefixCache(cache_minimum)
        self._arrived: dict[int, Any] = {}   # request body id -> the cache as it arrived
        self.batch_polls = batch_polls   # polls of a batch before it has ended
        self.batch_faults: deque[Fault] = deque()
        self.answer = answer
        self.latency = latency
        self.faults: deque[Fault] = deque()
        self.fault_count = 0
        self.serial = False
        self.max_model_len: int | None = None   # served in /v1/models as vLLM's ModelCard
        self.capacity: int | None = None   # at most this many requests served at once
        self._slots: asyncio.Semaphore | None = None
        self.in_flight_max = 0   # serial mode: the deepest queue seen
        self._lock: asyncio.Lock | None = None
        self.hits: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.tokens = (prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens)
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.host = "127.0.0.1"

    # -- control ---------------------------------------------------------------------------

    def push(self, kind: str, **kw: Any) -> None:
        """Apply a fault to the next chat/messages request: 429, 500, 529, drop, slow,
        truncate, invalid_json, schema_violation, refusal, fewer_choices, or raw (a reply of
        the given ``status``, ``body``, ``headers`` and ``content_type``)."""
        self.faults.append((kind, kw))

    def push_batch(self, kind: str, **kw: Any) -> None:
        """Apply a fault to the next batch-API request (create, poll, results) of either
        provider: 429, 500, 529, 400 (rejected), drop."""
        self.batch_faults.append((kind, kw))

    async def _batch_fault(self, request: web.Request) -> web.Response | None:
        if not self.batch_faults:
            return None
        kind, kw = self.batch_faults.popleft()
        self.fault_count += 1
        if kind == "drop":
            _drop(request)
            return web.Response(status=500)
        return web.json_response({"error": {"message": kw.get(
            "message", f"injected batch {kind} #{self.fault_count}"), "type": "x"}},
            status=int(kind))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeLLMServer:
        ready = threading.Event()
        self.host = host if host not in ("0.0.0.0", "::") else "127.0.0.1"

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_post("/v1/chat/completions", self.chat)
            app.router.add_post("/v1/messages", self.messages)
            app.router.add_post("/v1/embeddings", self.embeddings)
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/files", self.upload)
            app.router.add_get("/v1/files/{id}/content", self.file_content)
            app.router.add_post("/v1/batches", self.create_batch)
            app.router.add_get("/v1/batches/{id}", self.get_batch)
            app.router.add_post("/v1/messages/batches", self.create_anthropic_batch)
            app.router.add_get("/v1/messages/batches/{id}", self.get_anthropic_batch)
            app.router.add_get("/v1/messages/batches/{id}/results", self.anthropic_results)
            # stop() does not wait out answers still sleeping their latency for a client that
            # gave up on them (a test's deadline): they are cancelled after half a second
            runner = self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port, backlog=2048)
            self._loop.run_until_complete(site.start())
            self.port = int(runner.addresses[0][1])   # (host, port, ...) of the bound socket
            ready.set()
            loop = self._loop
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is None or self._runner is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None   # stopped: a second stop() (a test's teardown) does nothing

    # -- shared ----------------------------------------------------------------------------

    async def _fault(self, request: web.Request) -> tuple[web.Response | None, str | None]:
        """Returns (response to send instead, or None; answer mutation or None)."""
        if not self.faults:
            return None, None
        kind, kw = self.faults.popleft()
        if kind in ("429", "500", "529"):
            self.fault_count += 1  # transient errors rarely repeat their body word for word
            headers = {"retry-after": str(kw["retry_after"])} if "retry_after" in kw else {}
            return web.json_response({"error": {"message": f"injected {kind} "
                                                f"#{self.fault_count}", "type": "x"}},
                                     status=int(kind), headers=headers), None
        if kind in ("400", "500_same"):  # a request the server will never take, as llama.cpp
            return web.json_response({"error": {"message": kw.get(
                "message", "Input should be 'text' or 'json_object'"), "type": "x"}},
                status=int(kind[:3])), None
        if kind == "401_echo":  # like a real API quoting the key it rejected
            auth = request.headers.get("Authorization", request.headers.get("x-api-key", ""))
            return web.json_response({"error": {"message": f"Incorrect API key provided: "
                                                f"{auth.removeprefix('Bearer ')}",
                                                "type": "invalid_request_error"}},
                                     status=401), None
        if kind == "drop":
            _drop(request)
            return web.Response(status=500), None
        if kind == "raw":  # any status, body and headers, as a server or a proxy may answer
            body = kw.get("body", b"")
            return web.Response(status=kw.get("status", 200), headers=kw.get("headers"),
                                body=body.encode() if isinstance(body, str) else body,
                                content_type=kw.get("content_type", "application/json")), None
        if kind == "slow":
            await asyncio.sleep(kw.get("seconds", 5))
            return None, None
        return None, kind

    def _mutate(self, kind: str | None, text: str) -> tuple[str, str]:
        if kind == "truncate":
            return text[: len(text) // 2], "length"
        if kind == "invalid_json":
            return text[:-1] + ",,}", "stop"
        if kind == "schema_violation":
            return json.dumps({"verdict": "maybe", "steps": "one"}), "stop"
        if kind == "refusal":
            return "I can't help with that.", "refusal"
        return text, "stop"

    # -- OpenAI ----------------------------------------------------------------------------

    def _completion(self, body: dict[str, Any], kind: str | None) -> dict[str, Any]:
        n = body.get("n", 1)
        if kind == "fewer_choices":
            n = max(1, n - 1)
        p, c, o, r = self.tokens
        choices = []
        out_tokens = 0
        for i in range(n):
            text, finish = self._mutate(kind, self.answer(body, i))
            refusal = text if finish == "refusal" else None
            out_tokens += len(count_tokens(text))
            choices.append({"index": i, "finish_reason": "stop" if refusal else finish,
                            "message": {"role": "assistant", "content": None if refusal else text,
                                        "refusal": refusal}})
        if self.caching:  # the prompt is billed once for its n choices
            prompt = openai_prompt(body)
            p, c = len(prompt), self._cached(body, lambda: self.openai_cache.openai(prompt))
            completion = out_tokens
        else:
            completion = o * n
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model"), "choices": choices,
                "usage": {"prompt_tokens": p, "completion_tokens": completion,
                          "total_tokens": p + completion,
                          "prompt_tokens_details": {"cached_tokens": c},
                          "completion_tokens_details": {"reasoning_tokens": r * n}}}

    async def _generate(self, request: web.Request, hit: str,
                        build: Callable[[dict[str, Any], str | None], dict[str, Any]]
                        ) -> web.StreamResponse:
        """Shared by chat completions and messages: record, wait, maybe fault, answer."""
        self.hits[hit] += 1
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.caching and self.latency:
            # Real caches hold a prefix once its prefill is done, not while it runs: a request
            # reads what requests answered before it arrived left, and leaves its own entries
            # when answered (calls sent at once miss each other, as they do at the providers).
            self._arrived[id(body)] = self._lookup(body, hit)
        if self.serial:  # one request at a time, as llama-cpp-python's server
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                self.in_flight_max = max(self.in_flight_max, len(self._lock._waiters or ()) + 1)
                await asyncio.sleep(self.latency)
        elif self.capacity:   # a server of fixed capacity: the rest queue
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.capacity)
            async with self._slots:
                await asyncio.sleep(self.latency)
        elif self.latency:
            await asyncio.sleep(self.latency)
        resp, kind = await self._fault(request)
        if resp is not None:
            return resp
        return web.json_response(build(body, kind))

    def _lookup(self, body: dict[str, Any], hit: str) -> tuple[Any, set[str]]:
        if hit == "chat":
            found, new = self.openai_cache.openai_lookup(openai_prompt(body))
            return found, new
        read, write, new = self.anthropic_cache.anthropic_lookup(*anthropic_prompt(body))
        return (read, write), new

    def _cached(self, body: dict[str, Any], now: Callable[[], Any]) -> Any:
        """The cache's answer for this request: as found when it arrived (with latency), or
        now; its entries are left either way."""
        arrived = self._arrived.pop(id(body), None)
        if arrived is None:
            return now()
        found, new = arrived
        cache = self.openai_cache if isinstance(found, int) else self.anthropic_cache
        cache.seen.update(new)
        return found

    async def models(self, request: web.Request) -> web.Response:
        """vLLM's model list: each ModelCard carries ``max_model_len`` (its context window)."""
        card: dict[str, Any] = {"id": "test-model", "object": "model", "owned_by": "vllm"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", self._completion)

    async def upload(self, request: web.Request) -> web.Response:
        fault = await self._batch_fault(request)
        if fault is not None:
            return fault
        self.hits["files"] += 1
        data = await request.post()
        upload = data.get("file")
        if not isinstance(upload, web.FileField):
            return web.json_response({"error": {"message": "no file part named 'file'",
                                                "type": "invalid_request_error"}}, status=400)
        raw = upload.file.read()
        fid = "file-" + uuid.uuid4().hex
        self.files[fid] = raw
        return web.json_response({"id": fid, "object": "file", "bytes": len(raw),
                                  "created_at": int(time.time()), "filename": "batch.jsonl",
                                  "purpose": "batch", "status": "processed"})

    async def file_content(self, request: web.Request) -> web.Response:
        fault = await self._batch_fault(request)
        if fault is not None:
            return fault
        return web.Response(body=self.files[request.match_info["id"]])

    def _batch(self, bid: str) -> dict[str, Any]:
        return self.batches[bid]

    async def create_batch(self, request: web.Request) -> web.Response:
        fault = await self._batch_fault(request)
        if fault is not None:
            return fault
        self.hits["batches"] += 1
        body = await request.json()
        bid = "batch_" + uuid.uuid4().hex
        self.batches[bid] = {"id": bid, "object": "batch", "endpoint": body["endpoint"],
                             "input_file_id": body["input_file_id"], "completion_window": "24h",
                             "status": "in_progress", "created_at": int(time.time()),
                             "output_file_id": None, "error_file_id": None, "polls": 0}
        return web.json_response(self._public(self.batches[bid]))

    @staticmethod
    def _public(b: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in b.items() if k != "polls"}

    async def get_batch(self, request: web.Request) -> web.Response:
        fault = await self._batch_fault(request)
        if fault is not None:
            return fault
        self.hits["batch_polls"] += 1
        b = self.batches[request.match_info["id"]]
        b["polls"] += 1
        if b["polls"] >= self.batch_polls and b["status"] != "completed":
            lines = []
            for line in self.files[b["input_file_id"]].decode().splitlines():
                item = json.loads(line)
                kind = None
                if self.faults:
                    kind = self.faults.popleft()[0]
                lines.append(json.dumps({"id": "r" + uuid.uuid4().hex, "custom_id": item["custom_id"],
                                         "response": {"status_code": 200, "request_id": "x",
                                                      "body": self._completion(item["body"], kind)},
                                         "error": None}))
            out = "file-" + uuid.uuid4().hex
            self.files[out] = ("\n".join(lines) + "\n").encode()
            b.update(status="completed", output_file_id=out)
        return web.json_response(self._public(b))

    async def embeddings(self, request: web.Request) -> web.Response:
        """Hashed bag-of-words vectors: texts sharing words get similar vectors."""
        self.hits["embeddings"] += 1
        body = await request.json()
        data = []
        for i, text in enumerate(body["input"]):
            vec = [0.0] * 64
            for w in text.lower().replace(".", " ").split():
                vec[sum(map(ord, w)) % 64] += 1.0
            data.append({"object": "embedding", "index": i, "embedding": vec})
        return web.json_response({"object": "list", "data": data, "model": body["model"],
                                  "usage": {"prompt_tokens": 1, "total_tokens": 1}})

    # -- Anthropic -------------------------------------------------------------------------

    def _message(self, body: dict[str, Any], kind: str | None) -> dict[str, Any]:
        p, c, o, r = self.tokens
        text, finish = self._mutate(kind, self.answer(body, 0))
        stop = {"stop": "end_turn", "length": "max_tokens", "refusal": "refusal"}[finish]
        write = 0
        if self.caching:
            tokens, marks = anthropic_prompt(body)
            c, write = self._cached(body, lambda: self.anthropic_cache.anthropic(tokens, marks))
            p, o = len(tokens), len(count_tokens(text))
        return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                "model": body.get("model"), "content": [{"type": "text", "text": text}],
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": p - c - write, "output_tokens": o,
                          "cache_read_input_tokens": c, "cache_creation_input_tokens": write,
                          "output_tokens_details": {"thinking_tokens": r}}}

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "messages", self._message)

    async def create_anthropic_batch(self, request: web.Request) -> web.Response:
        fault = await self._batch_fault(request)
        if fault is not None:
            return fault
        self.hits["anthropic_batches"] += 1
        body = await request.json()
        bid = "msgbatch_" + uuid.uuid4().hex
        self.batches[bid] = {"requests": body["requests"], "polls": 0, "ended": False}
        return web.json_response(self._anthropic_batch(bid))

    def _anthropic_batch(self, bid: str) -> dict[str, Any]:
        b = self.batches[bid]
        n = len(b["requests"])
        return {"id": bid, "type": "message_batch",
                "processing_status": "ended" if b["ended"] else "in_progress",
                "request_counts": {"processing": 0 if b["ended"] else n,
                                   "succeeded": n if b["ended"] else 0, "errored": 0,
                                   "canceled": 0, "expired": 0},
                "created_at": "2026-01-01T00:00:00Z", "expires_at": "2026-01-02T00:00:00Z",
                "ended_at": "2026-01-01T00:01:00Z" if b["ended"] else None,
                "cancel_initiated_at": None, "archived_at": None,
                "results_url": f"{self.url}/v1/messages/batches/{bid}/results" if b["ended"] else None}

    async def get_anthropic_batch(self, request: web.Request) -> web.Response:
        fault = await self._batch_fault(request)
        if fault is not None:
            return fault
        self.hits["batch_polls"] += 1
        bid = request.match_info["id"]
        b = self.batches[bid]
        b["polls"] += 1
        if b["polls"] >= self.batch_polls and not b["ended"]:
            b["ended"] = True
            # answered once, in order, when the batch ends (the cache sees them as it would)
            b["results"] = [json.dumps({"custom_id": r["custom_id"], "result": {
                "type": "succeeded", "message": self._message(r["params"], None)}})
                for r in b["requests"]]
        return web.json_response(self._anthropic_batch(bid))

    async def anthropic_results(self, request: web.Request) -> web.Response:
        fault = await self._batch_fault(request)
        if fault is not None:
            return fault
        b = self.batches[request.match_info["id"]]
        lines = b.get("results") or []
        return web.Response(body=("\n".join(lines) + "\n").encode(),
                            content_type="application/binary")


def _drop(request: web.Request) -> None:
    """Close the connection under a request (a dropped connection, as the client sees it)."""
    if request.transport is not None:
        request.transport.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Serve the test LLM server until killed.")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--latency", type=float, default=0.0)
    args = parser.parse_args()
    FakeLLMServer(answer=schema_answer, latency=args.latency, caching=True,
                  batch_polls=1).start(args.host, args.port)
    while True:
        time.sleep(3600)


schema_of = _schema_of   # for tests scripting answers: the schema in whichever form it was sent
