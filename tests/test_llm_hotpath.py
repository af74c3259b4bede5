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

from draco_cli.judge.core import ScoreAnswer
from draco_cli.llm.adaptive import AdaptiveLimit
from draco_cli.llm.providers.openai import wire_json
from draco_cli.llm.types import LLMRequest, Sampling
from tests.conftest import examples


def documented_hash(r: LLMRequest, sample: int, model: str | None) -> str:
    payload = {"model": model, "messages": r.messages, "schema": r.schema(),
               "sampling": asdict(r.sampling), "template": r.template_version, "sample": sample}
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


texts = st.text(min_size=0, max_size=40)


@settings(max_examples=examples(60), deadline=None)
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


@settings(max_examples=examples(40), deadline=None)
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
            async with lim:
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


def test_tls_context_made_once_per_process_and_follows_ssl_cert_file(monkeypatch, tmp_path):
    """Every client used to load the CA bundle twice (~30 ms each) before its first call; the
    context is now shared, and a changed SSL_CERT_FILE still gets a context of its own."""
    import ssl

    import httpx2

    from draco_cli.llm.providers import make_provider
    from draco_cli.llm.providers.http import tls_context

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-tls-only")
    first = tls_context()
    assert isinstance(first, ssl.SSLContext) and first.verify_mode == ssl.CERT_REQUIRED
    assert tls_context() is first
    provider = make_provider("openai/m", base_url="https://127.0.0.1:1/v1")
    assert provider.client._client._transport.ssl_context is first   # the SDK's transport

    async def direct_connector_ssl() -> object:
        assert provider.direct is not None
        session = provider.direct._open()
        try:
            return session.connector._ssl
        finally:
            await provider.close()

    assert asyncio.run(direct_connector_ssl()) is first
    # a CA bundle of the user's own: its context is made from it, not served from the cache
    import os

    system = next(f for f in (ssl.get_default_verify_paths().openssl_cafile,
                              "/etc/ssl/certs/ca-certificates.crt") if f and os.path.isfile(f))
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(open(system, "rb").read())
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    own = tls_context()
    assert own is not first and own is tls_context()
    assert own.cert_store_stats() == httpx2.create_ssl_context(verify=True).cert_store_stats()
