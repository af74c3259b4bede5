"""Batch APIs (OpenAI Batch, Anthropic Message Batches): half price, answers within hours.

What the call log already answers is not sent. A submitted batch is recorded in the log with
the map from its custom ids to requests before polling starts, so a rerun after a kill polls
the same batch instead of paying for a second one. Answers go through the same validation as
online calls; re-asks for invalid answers are made online.
"""

from __future__ import annotations

import asyncio
import json

from draco_cli.llm.errors import LLMError
from draco_cli.llm.providers import AnthropicProvider, OpenAIProvider, anthropic_choice, \
    anthropic_usage, openai_reply
from draco_cli.llm.types import Answer, LLMRequest, Reply, Usage


async def run_batch(client, provider, requests: list[LLMRequest], poll_seconds: float,
                    progress) -> list[list[Answer]]:
    if not isinstance(provider, (OpenAIProvider, AnthropicProvider)):
        raise LLMError(f"{client.model}: no batch API for this provider; drop --batch")
    model = client.model
    tick = client._ticker(requests, progress)
    answers: list[list[Answer | None]] = [[None] * r.samples for r in requests]
    by_hash: dict[str, int] = {}
    todo: list[tuple[int, list[int]]] = []
    for k, req in enumerate(requests):
        missing = []
        for i in range(req.samples):
            hit = client._cache.get((req.hash(i, model), i))
            if hit is not None:
                answers[k][i] = Answer(i, "ok", req.answer_model.model_validate_json(hit.parsed),
                                       text=hit.answer_text, cached=True)
                client.stats[req.phase].cached += 1
            else:
                missing.append(i)
        by_hash[req.hash(0, model)] = k
        if missing:
            groups = [missing] if provider.supports_n else [[i] for i in missing]
            todo += [(k, g) for g in groups]

    phases = sorted({r.phase for r in requests})
    covered: set[tuple[int, int]] = set()
    jobs = []
    # Resume batches a killed run already paid for.
    for phase in phases:
        for batch_id, mapping in client.log.pending_batches(provider.name, model, phase):
            resolved = {cid: (by_hash[h], samples) for cid, (h, samples) in mapping.items()
                        if h in by_hash}
            jobs.append((batch_id, resolved))
            covered |= {(k, i) for k, samples in resolved.values() for i in samples}
    todo = [(k, [i for i in g if (k, i) not in covered]) for k, g in todo]
    todo = [(k, g) for k, g in todo if g]
    if todo:
        jobs.append(await _submit(client, provider, requests, todo))

    for batch_id, mapping in jobs:
        results = await _collect(provider, batch_id, poll_seconds)
        for cid, (k, samples) in mapping.items():
            req = requests[k]
            stats = client.stats[req.phase]
            entry = results.get(cid)
            if entry is None:
                for i in samples:
                    answers[k][i] = client._final_unanswered(
                        req, i, f"batch {batch_id}: no result for {cid}", Usage(), 0.0, 0)
                continue
            reply, request_body = entry
            stats.calls += 1
            stats.usage = stats.usage + reply.usage
            cost = client._cost_of(reply)
            stats.cost_usd += cost
            client.spent += cost
            share = 1.0 / max(len(reply.choices), 1)
            for i, choice in zip(samples, reply.choices):
                answers[k][i] = await client._settle(provider, req, i, choice, reply, share)
            for i in samples[len(reply.choices):]:
                answers[k][i] = client._unanswered(req, i, "fewer choices than asked", reply,
                                                   share, 0)
        client.log.finish_batch(batch_id)
    out = [[a for a in row] for row in answers]
    for row in out:
        tick(row)
    return out  # type: ignore[return-value]


async def _submit(client, provider, requests, todo) -> tuple[str, dict]:
    lines, mapping, record = [], {}, {}
    for n, (k, samples) in enumerate(todo):
        req = requests[k]
        cid = f"r{n}"
        body = provider.body(req, req.messages, len(samples))
        body.update(body.pop("extra_body", {}))  # SDK-only key: in a batch file it is the body
        lines.append(body)
        mapping[cid] = (k, samples)
        record[cid] = (req.hash(0, client.model), samples)
    if isinstance(provider, OpenAIProvider):
        payload = "\n".join(json.dumps({"custom_id": cid, "method": "POST",
                                        "url": "/v1/chat/completions", "body": b})
                            for cid, b in zip(mapping, lines)) + "\n"
        f = await provider.client.files.create(file=("draco-batch.jsonl", payload.encode()),
                                               purpose="batch")
        batch = await provider.client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    else:
        batch = await provider.client.messages.batches.create(
            requests=[{"custom_id": cid, "params": b} for cid, b in zip(mapping, lines)])
    phase = requests[todo[0][0]].phase
    client.log.record_batch(batch.id, provider.name, client.model, phase, record)
    return batch.id, mapping


async def _collect(provider, batch_id: str, poll_seconds: float) -> dict[str, tuple[Reply, dict]]:
    """Poll until the batch ends; return custom_id -> (reply, request body)."""
    out: dict[str, tuple[Reply, dict]] = {}
    if isinstance(provider, OpenAIProvider):
        while True:
            b = await provider.client.batches.retrieve(batch_id)
            if b.status in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(poll_seconds)
        if b.status != "completed" or not b.output_file_id:
            raise LLMError(f"batch {batch_id} ended as {b.status}; rerun without --batch to "
                           "answer the rest online")
        content = await provider.client.files.content(b.output_file_id)
        for line in content.text.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            resp = item.get("response") or {}
            if resp.get("status_code") == 200:
                out[item["custom_id"]] = (openai_reply(resp["body"], {}, batch_id), {})
        return out
    while True:
        b = await provider.client.messages.batches.retrieve(batch_id)
        if b.processing_status == "ended":
            break
        await asyncio.sleep(poll_seconds)
    results = await provider.client.messages.batches.results(batch_id)
    async for entry in results:
        data = entry.model_dump(mode="json")
        result = data.get("result") or {}
        if result.get("type") == "succeeded":
            message = result["message"]
            reply = Reply([anthropic_choice(message)], anthropic_usage(message.get("usage") or {}),
                          {}, message, 0.0, batch_id)
            out[data["custom_id"]] = (reply, {})
    return out  # errored or expired entries are absent: those samples end unanswered
