"""The LLM layer's hot path keeps its contracts: cache keys equal to the documented formula
(logs written by earlier versions stay valid), the body sent equal to the body built, slots
handed out first come first served."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import asdict

from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.judge import ScoreAnswer
from draco_cli.llm.adaptive import AdaptiveLimit
from draco_cli.llm.providers import wire_json
from draco_cli.llm.types import LLMRequest, Sampling


def documented_hash(r: LLMRequest, sample: int, model: str | None) -> str:
    payload = {"model": model, "messages": r.messages, "schema": r.schema(),
               "sampling": asdict(r.sampling), "template": r.template_version, "sample": sample}
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


texts = st.text(min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), texts), max_size=4),
       texts, st.one_of(st.none(), st.floats(0, 2)), st.one_of(st.none(), st.integers(0, 9)),
       st.integers(0, 5), st.one_of(st.none(), texts),
       st.dictionaries(texts, st.one_of(st.integers(), texts), max_size=3))
def test_cache_key_is_the_documented_hash(msgs, template, temp, seed, sample, model, schema):
    r = LLMRequest(phase="score", messages=[{"role": a, "content": b} for a, b in msgs],
                   answer_model=ScoreAnswer, json_schema=schema or None, template_version=template,
                   sampling=Sampling(temperature=temp, seed=seed))
    assert r.hash(sample, model) == documented_hash(r, sample, model)
    assert r.hash(sample, None) == documented_hash(r, sample, None)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user"]), texts), max_size=3),
       st.dictionaries(st.sampled_from(["model", "n", "max_tokens", "seed"]),
                       st.one_of(st.integers(), texts), max_size=4))
def test_the_body_sent_is_the_body_built(msgs, rest):
    r = LLMRequest(phase="p", messages=[{"role": a, "content": b} for a, b in msgs],
                   answer_model=ScoreAnswer)
    wire = {**rest, "messages": r.messages}
    assert json.loads(wire_json(wire, r)) == wire
    other = {**rest, "messages": [dict(m) for m in r.messages] + [{"role": "user", "content": "x"}]}
    assert json.loads(wire_json(other, r)) == other


def test_slots_go_to_waiters_in_arrival_order_and_a_cancelled_waiter_gives_its_turn_up():
    async def scenario():
        lim = AdaptiveLimit(1, adaptive=False)
        order: list[int] = []

        async def user(i: int, hold: float) -> None:
            async with lim.slot():
                order.append(i)
                assert lim.in_flight == 1
                await asyncio.sleep(hold)

        first = asyncio.ensure_future(user(0, 0.05))
        await asyncio.sleep(0)
        tasks = [asyncio.ensure_future(user(i, 0.0)) for i in range(1, 5)]
        await asyncio.sleep(0)
        tasks[1].cancel()          # waiter 2 leaves the queue before its turn
        await asyncio.gather(first, *tasks, return_exceptions=True)
        return order, lim.in_flight

    order, left = asyncio.run(scenario())
    assert order == [0, 1, 3, 4] and left == 0
