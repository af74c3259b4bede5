"""A request's schema encoded once per ``schema_key`` (the judge's per group and step count)
gives the same cache keys and the same bytes on the wire as encoding it per request."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import asdict, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.judge.core import _score_request, score_schema
from draco_cli.llm.providers.openai import OpenAIProvider
from draco_cli.llm.types import LLMRequest, Sampling
from draco_cli.prompts import load_prompt
from draco_cli.prompts.render import RenderOptions
from tests.conftest import examples


def documented_hash(r: LLMRequest, sample: int, model: str | None) -> str:
    payload = {"model": model, "messages": r.messages, "schema": r.schema(),
               "sampling": asdict(r.sampling), "template": r.template_version, "sample": sample}
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def provider(monkeypatch) -> OpenAIProvider:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-local-only")
    return OpenAIProvider("m", base_url="http://127.0.0.1:9/v1", concurrency=2, timeout=5)


ids_ = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4, unique=True)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.tuples(ids_, st.integers(0, 4), st.text(max_size=20)), min_size=1,
                max_size=6),
       st.one_of(st.none(), st.floats(0, 2)), st.integers(1, 3))
def test_shared_schema_gives_the_same_keys_and_body(rollouts, temp, samples):
    import pytest

    mp = pytest.MonkeyPatch()
    try:
        p = provider(mp)
        schemas: dict = {}
        sampling = Sampling(temperature=temp)
        for ids, m, text in rollouts:
            shared = _score_request("r", text, list(range(1, m + 1)), [text] * m, [text] * m,
                                    ids, "listing", samples, sampling, RenderOptions(),
                                    load_prompt("score"), schemas)
            alone = replace(shared, schema_key=None, json_schema=score_schema(ids, m))
            assert shared.json_schema == alone.json_schema
            for sample in range(samples):
                for model in ("m", None):
                    assert shared.hash(sample, model) == alone.hash(sample, model) == \
                        documented_hash(alone, sample, model)
            for n in (1, samples):
                assert p.wire(shared, shared.messages, n)[1] == \
                    p.wire(alone, alone.messages, n)[1]
    finally:
        asyncio.run(p.close())
        mp.undo()


def test_a_group_shares_one_schema_object_per_step_count():
    schemas: dict = {}
    made = [_score_request("r", "t", list(range(1, m + 1)), ["a"] * m, ["o"] * m, ["c1", "c2"],
                           "l", 1, Sampling(), RenderOptions(), load_prompt("score"), schemas)
            for m in (3, 3, 5)]
    assert made[0].json_schema is made[1].json_schema
    assert made[2].json_schema is not made[0].json_schema
    assert made[0].schema_key != made[2].schema_key
