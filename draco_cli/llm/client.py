"""The one client every LLM stage uses: cache, concurrency, rate limits, retries, validation,
cost and budget, written once around a small provider. Usage: docs/llm.md, "Using it from
Python"; validation and re-asks: "Structured answers".
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import replace

from pydantic import ValidationError

from draco_cli.llm.adaptive import AdaptiveLimit
from draco_cli.llm.answers import parse_choice, reask
from draco_cli.llm.batch import run_batch
from draco_cli.llm.calllog import CallLog
from draco_cli.llm.errors import BudgetReached, ReplyRefused, RequestRejected, Retryable
from draco_cli.llm.keys import scrub
from draco_cli.llm.limits import RateLimiter
from draco_cli.llm.pool import EndpointPool
from draco_cli.llm.prices import PriceTable
from draco_cli.llm.providers import Provider, batches_by_default, make_provider, parse_model_id
from draco_cli.llm.retry import RetryPolicy
from draco_cli.llm.rows import Rows
from draco_cli.llm.types import (Answer, Choice, LLMRequest, PhaseStats, Progress, Reply,
                                 RequestStream, Usage)

# A streamed request list yields to the event loop after this many requests are built.
STREAM_STEP = 4
# Providers that answer locally: nothing to pay, nothing to adapt to.
FREE = ("replay", "mock")


class LLMClient:

    def __init__(
        self,
        model: str,
        *,
        call_log: CallLog,
        concurrency: int = 16,
        rpm: float | None = None,
        tpm: float | None = None,
        timeout: float = 120.0,
        max_retries: int = 6,
        parse_retries: int = 2,
        max_cost: float | None = None,
        prices: PriceTable | None = None,
        base_url: str | tuple[str, ...] | None = None,   # several: a fleet (llm/pool.py)
        backoff_base: float = 1.0,
        backoff_cap: float = 60.0,
        structured_output: str | None = None,
        system_role: bool = True,
        use_n: bool = True,
        temperature: float | None = None,
        seed: int | None = None,
        adaptive: bool | None = None,
        deadline: float | None = None,
        max_reply_bytes: int | None = None,   # None: the providers' default (32 MiB)
    ) -> None:
        self.model = model
        self.provider_name, _ = parse_model_id(model)
        self.log = call_log
        self.concurrency = concurrency
        # a server's Retry-After is waited at most the call's own timeout
        self.retry = RetryPolicy(max_retries, backoff_base, backoff_cap, wait_cap=timeout)
        self.max_reply_bytes = max_reply_bytes
        self.parse_retries = parse_retries
        self.max_cost = max_cost
        self.prices = prices or PriceTable.load()
        self.base_url = base_url
        self.timeout = timeout
        self.rpm, self.tpm = rpm, tpm
        self.stats: dict[str, PhaseStats] = defaultdict(PhaseStats)
        self.spent = 0.0
        self.budget_reached = False
        self.priced = self.provider_name in FREE or self.prices.price(model) is not None
        self.structured_output = structured_output
        self.system_role = system_role
        self.use_n = use_n
        # Client-wide sampling for what a request leaves unset (they enter its cache key).
        self.temperature, self.seed = temperature, seed
        self.reserved = 0.0       # estimated cost of calls in flight (--max-cost)
        # --concurrency is the ceiling; the limit in use follows the server (adaptive.py).
        # Default: adapt for self-hosted servers; hosted APIs limit by rate, not parallelism.
        self.adaptive = adaptive if adaptive is not None else (
            (base_url or os.environ.get("DRACO_BASE_URL")) is not None
            and self.provider_name not in FREE)
        # seconds a request (every attempt and re-ask of it) may take before it ends unanswered
        self.deadline = deadline
        self._shared: Provider | None = None   # the provider of an open ``session()``
        self._cache = call_log.answered()
        self.rows = Rows(call_log, self.provider_name, model, self.priced)

    # -- public ----------------------------------------------------------------------------

    def run(self, requests: Iterable[LLMRequest],
            progress: Callable[[Progress], None] | None = None, batch: bool | None = False,
            poll_seconds: float = 30.0) -> list[list[Answer]]:
        """Answer every request (blocking); see ``arun``."""
        return asyncio.run(self.arun(requests, progress, batch, poll_seconds))

    @asynccontextmanager
    async def session(self) -> AsyncIterator[LLMClient]:
        """Share one connection pool, concurrency limit and rate limiter between every
        ``arun`` inside, concurrent ones included: the in-loop API answers many groups at once
        under one bound."""
        provider = self._shared = self._open()
        try:
            yield self
        finally:
            self._shared = None
            await provider.close()
            self.log.flush()

    def _open(self) -> Provider:
        urls: list[str | None] = [self.base_url] \
            if isinstance(self.base_url, str) or self.base_url is None else list(self.base_url)

        def one(url: str | None) -> Provider:
            return make_provider(self.model, base_url=url, concurrency=self.concurrency,
                                 timeout=self.timeout, structured_output=self.structured_output,
                                 system_role=self.system_role, use_n=self.use_n,
                                 max_reply_bytes=self.max_reply_bytes)

        provider: Provider
        if len(urls) > 1:
            # more than one URL: base_url was a tuple of str
            pool = EndpointPool([(u, one(u)) for u in urls if u is not None])
            pool.on_failure = self._pool_failure
            provider = pool
        else:
            provider = one(urls[0])
        self.limit = AdaptiveLimit(self.concurrency, adaptive=self.adaptive)
        self._limiter = RateLimiter(self.rpm, self.tpm)
        return provider

    async def arun(self, requests: Iterable[LLMRequest],
                   progress: Callable[[Progress], None] | None = None,
                   batch: bool | None = False, poll_seconds: float = 30.0) -> list[list[Answer]]:
        """Answer every request. ``batch=True`` sends what the call log does not already hold
        through the provider's batch API (half price; resumable by batch id); ``None`` does so
        where ``batches_by_default`` says (the offline commands). A ``RequestStream`` is
        answered as it is produced: the first calls go out while the producer builds the rest."""
        shared = self._shared
        provider = shared if shared is not None else self._open()
        try:
            return await self._arun(provider, requests, progress, batch, poll_seconds)
        finally:
            if shared is None:
                await provider.close()
                self.log.flush()

    async def _arun(self, provider: Provider, requests: Iterable[LLMRequest],
                    progress: Callable[[Progress], None] | None, batch: bool | None,
                    poll_seconds: float) -> list[list[Answer]]:
        if batch or (batch is None and self.batches_by_default(provider)):
            requests = [self._with_defaults(r) for r in requests]
            return await run_batch(self, provider, requests, poll_seconds, progress)
        if not isinstance(requests, RequestStream):
            requests = list(requests)
        # A list goes the same way as a stream: each request is hashed and looked up when
        # its turn comes, so the first calls go out before the last request is hashed.
        return await self._answer_stream(provider, requests, self.ticker(requests, progress))

    # -- the batch path's view of the client (llm/batch.py): the same cache, bookkeeping,
    # validation and re-asks as online calls, through public methods -----------------------

    def batches_by_default(self, provider: Provider) -> bool:
        return batches_by_default(self.base_url, provider)

    def recorded(self, req: LLMRequest) -> list[Answer | None]:
        """Per sample of ``req``: its valid answer from the call log, or None (to be asked)."""
        out: list[Answer | None] = []
        for i in range(req.samples):
            hit = self._cache.get((req.hash(i, self.model), i))
            value = None
            if hit is not None:
                try:
                    value = req.answer_model.model_validate_json(hit.parsed)
                except ValidationError:
                    value = None
                # An answer logged before a check existed is served only if it passes it.
                if value is not None and req.problem(value) is not None:
                    value = None
                if value is not None:
                    self.stats[req.phase].cached += 1
                    out.append(Answer(i, "ok", value, text=hit.answer_text, cached=True))
                    continue
            out.append(None)
        return out

    def account(self, req: LLMRequest, reply: Reply) -> None:
        """Count one paid HTTP reply (a batch line) in the phase's calls, tokens and dollars."""
        stats = self.stats[req.phase]
        stats.priced = self.priced
        stats.calls += 1
        stats.usage = stats.usage + reply.usage
        cost = self._cost_of(reply)
        stats.cost_usd += cost
        self.spent += cost

    async def settle(self, provider: Provider, req: LLMRequest, samples: list[int],
                     reply: Reply) -> list[Answer]:
        """Validate a reply's choices for ``samples`` as an online reply's are: invalid answers
        re-asked, samples the reply lacks (fewer choices than asked) asked again one per call."""
        share = 1.0 / max(len(reply.choices), 1)
        out = [await self._settle(provider, req, i, choice, reply, share)
               for i, choice in zip(samples, reply.choices)]
        # A server that ignores n (llama.cpp) returns fewer choices than asked: the missing
        # samples are asked again, one per call.
        for group in await asyncio.gather(*(self._ask(provider, req, [i])
                                            for i in samples[len(reply.choices):])):
            out += group
        return out

    def unanswered(self, req: LLMRequest, sample: int, reason: str) -> Answer:
        """Record ``sample`` of ``req`` as unanswered (asked again by a rerun)."""
        return self._final_unanswered(req, sample, reason, Usage(), 0.0, 0)

    async def _answer_stream(self, provider: Provider, requests: Iterable[LLMRequest],
                             tick: Callable[[list[Answer]], None]) -> list[list[Answer]]:
        tasks: list[asyncio.Future[list[Answer]]] = []
        try:
            for r in requests:
                tasks.append(asyncio.ensure_future(
                    self._answer(provider, self._with_defaults(r), tick)))
                if len(tasks) % STREAM_STEP == 0:
                    await asyncio.sleep(0)   # let the calls made so far go out
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return list(await asyncio.gather(*tasks))

    def ticker(self, requests: list[LLMRequest] | RequestStream,
                progress: Callable[[Progress], None] | None) -> Callable[[list[Answer]], None]:
        total = requests.samples if isinstance(requests, RequestStream) else \
            sum(r.samples for r in requests)
        done = [0, 0]

        def tick(answers: list[Answer]) -> None:
            done[0] += len(answers)
            done[1] += sum(a.status != "ok" for a in answers)
            if progress:
                progress(Progress(done[0], total, done[1], self.spent, priced=self.priced))

        return tick

    def _with_defaults(self, req: LLMRequest) -> LLMRequest:
        s = req.sampling
        if (self.temperature is None or s.temperature is not None) and \
                (self.seed is None or s.seed is not None):
            return req
        sampling = replace(s, temperature=s.temperature if s.temperature is not None
                           else self.temperature, seed=s.seed if s.seed is not None else self.seed)
        return replace(req, sampling=sampling)

    # -- one request -----------------------------------------------------------------------

    async def _answer(self, provider: Provider, req: LLMRequest,
                      tick: Callable[[list[Answer]], None]) -> list[Answer]:
        stats = self.stats[req.phase]
        stats.priced = self.priced
        answers = self.recorded(req)
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            groups = [missing] if provider.supports_n else [[i] for i in missing]
            # One sample ahead of the rest: a provider's prompt cache holds a prompt once its
            # prefill is done, so samples sent together would each pay (or write) it.
            results = [await self._ask_in_time(provider, req, groups[0])]
            if len(groups) > 1:
                results += await asyncio.gather(*(self._ask_in_time(provider, req, g)
                                                  for g in groups[1:]))
            for group in results:
                for a in group:
                    answers[a.sample] = a
        final = [a for a in answers if a is not None]
        tick(final)
        return final

    async def _ask_in_time(self, provider: Provider, req: LLMRequest,
                           samples: list[int]) -> list[Answer]:
        if self.deadline is None:
            return await self._ask(provider, req, samples)
        try:
            return await asyncio.wait_for(self._ask(provider, req, samples), self.deadline)
        except asyncio.TimeoutError:
            # cancelled mid-call: its slot and budget reservation are released on the way out
            return [self._final_unanswered(req, i, f"no answer within the deadline "
                                           f"({self.deadline:g} s)", Usage(), 0.0, 0)
                    for i in samples]

    async def _ask(self, provider: Provider, req: LLMRequest, samples: list[int]) -> list[Answer]:
        """Ask for ``samples`` in one call, then validate each choice on its own, re-asking
        (one sample per call) with the validation error fed back."""
        try:
            reply = await self._call(provider, req, req.messages, samples)
        except BudgetReached:
            self.stats[req.phase].skipped += len(samples)
            return [Answer(i, "skipped", reason="budget reached (--max-cost)") for i in samples]
        except ReplyRefused as exc:   # too large, or impossible token counts: nothing counted
            return [self._final_unanswered(req, i, str(exc), Usage(), 0.0, 0) for i in samples]
        if not reply.choices:   # each sample bears its share of what the call cost
            share = 1.0 / len(samples)
            return [self._final_unanswered(req, i, "the server returned no choice",
                                           reply.usage.scaled(share),
                                           self._cost_of(reply) * share, 0) for i in samples]
        return await self.settle(provider, req, samples, reply)

    async def _settle(self, provider: Provider, req: LLMRequest, sample: int, choice: Choice,
                      reply: Reply, share: float) -> Answer:
        attempt = 0
        usage = reply.usage.scaled(share)
        cost = self._cost_of(reply) * share
        asked = req.messages
        while True:
            value, status, error = parse_choice(req, choice)
            self.rows.answer(req, sample, attempt, status, error, reply, choice, value, share,
                             self._cost_of(reply) * share)
            if status == "ok":
                self.stats[req.phase].answered += 1
                return Answer(sample, "ok", value, text=choice.text, usage=usage, cost_usd=cost,
                              attempts=attempt + 1)
            again = reask(req, choice, status, error)
            # Greedy decoding (temperature 0) answers the same messages the same way: a re-ask
            # that repeats them (a truncation, or the same invalid answer given twice) would
            # only pay for that answer again.
            if status == "refused" or attempt >= self.parse_retries or (
                    req.sampling.temperature == 0 and again == asked):
                return self._final_unanswered(req, sample, error, usage, cost, attempt)
            attempt += 1
            asked = again
            try:
                reply = await self._call(provider, req, again, [sample])
            except BudgetReached:
                return self._final_unanswered(req, sample, "budget reached during re-ask",
                                              usage, cost, attempt)
            except ReplyRefused as exc:
                return self._final_unanswered(req, sample, str(exc), usage, cost, attempt)
            choice = reply.choices[0] if reply.choices else Choice(None, "empty")
            share = 1.0
            usage = usage + reply.usage
            cost += self._cost_of(reply)

    def _final_unanswered(self, req: LLMRequest, sample: int, reason: str | None, usage: Usage,
                          cost: float, attempt: int) -> Answer:
        self.stats[req.phase].unanswered += 1
        self.rows.unanswered(req, sample, attempt, reason)
        return Answer(sample, "unanswered", reason=reason, usage=usage, cost_usd=cost,
                      attempts=attempt + 1)

    # -- one HTTP call, with retries ---------------------------------------------------------

    def _cost(self, usage: Usage, batch: bool = False) -> float:
        if self.provider_name in FREE or not self.priced:
            return 0.0   # (an unpriced model's lookup would scan the whole table each call)
        return max(0.0, self.prices.cost(self.model, usage, batch))   # never lowers the total

    def _cost_of(self, reply: Reply) -> float:
        return self._cost(reply.usage, reply.batch_id is not None)

    def _estimate(self, req: LLMRequest, messages: list[dict[str, str]],
                  n: int) -> tuple[int, float]:
        """Tokens (for --tpm) and a dollar estimate (for --max-cost) of one call: the phase's
        mean billed cost per sample so far, or before any reply the prompt at ~4 characters a
        token with every answer at max_tokens."""
        prompt = sum(len(m["content"]) for m in messages) // 4
        tokens = prompt + req.sampling.max_tokens
        if self.max_cost is None:
            return tokens, 0.0   # the dollar estimate only serves --max-cost
        st = self.stats[req.phase]
        billed = st.answered + st.unanswered
        if billed and st.cost_usd > 0:
            return tokens, st.cost_usd / max(billed, 1) * n
        usd = self._cost(Usage(input_tokens=prompt, output_tokens=req.sampling.max_tokens * n))
        return tokens, usd

    def _pool_failure(self, req: LLMRequest, samples: list[int], exc: Retryable,
                      endpoint: str) -> None:
        """An endpoint of the fleet failed a call (retried elsewhere, or by ``_call``)."""
        stats = self.stats[req.phase]
        stats.failed_attempts += 1
        stats.calls += 1
        self.rows.failure(req, samples, 0, str(exc), exc.body, endpoint)

    @property
    def where(self) -> str:
        """The model, and the server when one is named: the head of a giving-up message."""
        return f"{self.model} at {self.base_url}" if self.base_url else self.model

    async def _call(self, provider: Provider, req: LLMRequest, messages: list[dict[str, str]],
                    samples: list[int]) -> Reply:
        stats = self.stats[req.phase]
        estimate, usd = self._estimate(req, messages, len(samples))
        last_body: str | None = None
        same = 0

        async def attempt(n: int) -> Reply:
            nonlocal usd, last_body, same
            await self._limiter.acquire(estimate)
            async with self.limit:
                # The call's estimated cost is reserved before it is sent, so the calls in
                # flight cannot together overshoot the budget by more than one call.
                # The first call goes out whatever its pessimistic estimate, to measure one.
                if self.max_cost is not None:
                    _, usd = self._estimate(req, messages, len(samples))
                committed = self.spent + self.reserved
                if self.max_cost is not None and (committed >= self.max_cost or (
                        committed > 0 and committed + usd > self.max_cost * (1 + 1e-9))):
                    self.budget_reached = True
                    raise BudgetReached()
                self.reserved += usd
                try:
                    return await provider.complete(req, messages, samples)
                except (RequestRejected, ReplyRefused) as exc:
                    stats.calls += 1
                    self.rows.failure(req, samples, n, str(exc), getattr(exc, "body", None))
                    raise
                except Retryable as exc:
                    if not exc.logged:  # the fleet logs its own failures
                        stats.failed_attempts += 1
                        stats.calls += 1
                        self.rows.failure(req, samples, n, str(exc), exc.body)
                    if exc.kind == "timeout":
                        self.limit.timed_out()
                    same = same + 1 if exc.body and exc.body == last_body else 0
                    if exc.status == 500 and same >= 2:
                        # Three 500s with one body: the server rejects this request (llama.cpp
                        # answers a request shape it does not take so), it is not busy.
                        raise RequestRejected(
                            f"{self.model}: HTTP 500 three times with the same body, so the "
                            f"server rejects the request itself: {(scrub(exc.body) or '')[:500]}",
                            body=exc.body, status=500) from None
                    last_body = exc.body
                    raise
                finally:
                    self.reserved -= usd

        reply = await self.retry.run(attempt, self.where)
        self.limit.completed()
        self.account(req, reply)
        return reply
