"""Batch APIs (OpenAI Batch, Anthropic Message Batches): half price, answers within hours.
What is sent and how a rerun resumes: see docs/llm.md, "Batch APIs".

Every exchange with the batch API (upload, create, poll, results) is retried like a single
call (``llm.retry``). Invalid answers and samples a line lacks (fewer choices than asked) are
re-asked online, one sample per call.

Only the public faces of the client and the provider are used here: the provider's batch
methods (``Provider.submit_batch`` and friends) and the client's ``recorded``, ``account``,
``settle`` and ``unanswered``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from draco_cli.llm.calllog import CallLog
from draco_cli.llm.errors import LLMError, RequestRejected
from draco_cli.llm.providers import Provider
from draco_cli.llm.retry import RetryPolicy
from draco_cli.llm.types import Answer, LLMRequest, Progress, Reply

T = TypeVar("T")


class BatchClient(Protocol):
    """The client as the batch path sees it (``LLMClient`` is one): its cache, bookkeeping,
    validation and re-asks, the same as online calls'."""

    model: str
    log: CallLog
    spent: float
    retry: RetryPolicy

    @property
    def where(self) -> str: ...

    def ticker(self, requests: list[LLMRequest], progress: Callable[[Progress], None] | None,
               ) -> Callable[[list[Answer]], None]: ...

    def recorded(self, req: LLMRequest) -> list[Answer | None]: ...

    def account(self, req: LLMRequest, reply: Reply) -> None: ...

    async def settle(self, provider: Provider, req: LLMRequest, samples: list[int],
                     reply: Reply) -> list[Answer]: ...

    def unanswered(self, req: LLMRequest, sample: int, reason: str) -> Answer: ...


async def retrying(client: BatchClient, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` under the client's retry policy: the same policy as a single call's."""
    try:
        return await client.retry.run(lambda _: call(), f"{client.where}: batch API")
    except RequestRejected as exc:
        raise LLMError(f"{exc} (a server without a batch API? drop --batch, or pass "
                       "--no-batch)" if exc.status in (404, 405) else str(exc)) from None


async def run_batch(client: BatchClient, provider: Provider, requests: list[LLMRequest],
                    poll_seconds: float,
                    progress: Callable[[Progress], None] | None) -> list[list[Answer]]:
    if not provider.offers_batch:
        raise LLMError(f"{client.model}: no batch API for this provider; drop --batch")
    tick = client.ticker(requests, progress)
    answers: list[list[Answer | None]] = [client.recorded(r) for r in requests]
    # Resume batches a killed run already paid for; submit one batch for what they lack.
    jobs = _pending(client, provider, requests)
    covered = {(k, i) for _, mapping in jobs for k, samples in mapping.values() for i in samples}
    todo: list[tuple[int, list[int]]] = []
    for k, row in enumerate(answers):
        missing = [i for i, a in enumerate(row) if a is None and (k, i) not in covered]
        if missing:
            groups = [missing] if provider.supports_n else [[i] for i in missing]
            todo += [(k, g) for g in groups]
    if todo:
        jobs.append(await _submit(client, provider, requests, todo))
    for batch_id, mapping in jobs:
        await _collect(client, provider, requests, batch_id, mapping, answers, poll_seconds,
                       progress)
    out = [[a for a in row if a is not None] for row in answers]
    for done in out:
        tick(done)
    return out


# A submitted batch: its id, and which request and samples each of its lines (custom id) asks.
Job = tuple[str, dict[str, tuple[int, list[int]]]]


def _pending(client: BatchClient, provider: Provider, requests: list[LLMRequest]) -> list[Job]:
    """The batches the call log records as submitted and not yet collected, for these
    requests (lines for requests no longer asked are left out)."""
    by_hash = {req.hash(0, client.model): k for k, req in enumerate(requests)}
    jobs: list[Job] = []
    for phase in sorted({r.phase for r in requests}):
        for batch_id, mapping in client.log.pending_batches(provider.name, client.model, phase):
            jobs.append((batch_id, {cid: (by_hash[h], samples)
                                    for cid, (h, samples) in mapping.items() if h in by_hash}))
    return jobs


async def _collect(client: BatchClient, provider: Provider, requests: list[LLMRequest],
                   batch_id: str, mapping: dict[str, tuple[int, list[int]]],
                   answers: list[list[Answer | None]], poll_seconds: float,
                   progress: Callable[[Progress], None] | None) -> None:
    """Poll one batch until it ends, then settle its lines into ``answers``."""
    total = sum(r.samples for r in requests)
    state = await retrying(client, lambda: provider.poll_batch(batch_id))
    while not state.ended:
        if progress is not None:
            progress(Progress(0, total, 0, client.spent, note=(
                f"batch {batch_id} {state.status} ({len(mapping)} requests); polling every "
                f"{poll_seconds:g} s, a rerun resumes it"), priced=getattr(client, "priced", True)))
        await asyncio.sleep(poll_seconds)
        state = await retrying(client, lambda: provider.poll_batch(batch_id))
    results = await retrying(client, lambda: provider.batch_results(batch_id))
    for cid, (k, samples) in mapping.items():
        req = requests[k]
        reply = results.get(cid)
        if reply is None:
            for i in samples:  # errored or expired line: a rerun asks it again
                answers[k][i] = client.unanswered(
                    req, i, f"batch {batch_id} ({state.status}): no result for line {cid}")
            continue
        reply.request_body = provider.batch_request(req, samples)
        client.account(req, reply)
        for a in await client.settle(provider, req, samples, reply):
            answers[k][a.sample] = a
    client.log.finish_batch(batch_id)


async def _submit(client: BatchClient, provider: Provider, requests: list[LLMRequest],
                  todo: list[tuple[int, list[int]]]) -> Job:
    lines: dict[str, dict[str, Any]] = {}
    mapping: dict[str, tuple[int, list[int]]] = {}
    record: dict[str, tuple[str, list[int]]] = {}
    for n, (k, samples) in enumerate(todo):
        req = requests[k]
        cid = f"r{n}"
        lines[cid] = provider.batch_request(req, samples)
        mapping[cid] = (k, samples)
        record[cid] = (req.hash(0, client.model), samples)
    batch_id = await retrying(client, lambda: provider.submit_batch(lines))
    phase = requests[todo[0][0]].phase
    client.log.record_batch(batch_id, provider.name, client.model, phase, record)
    return batch_id, mapping
