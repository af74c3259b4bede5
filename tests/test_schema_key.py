"""The judge's score requests give the documented cache keys, and the same keys and bytes on
the wire as a request carrying a freshly built schema."""

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
        sampling = Sampling(temperature=temp)
        for ids, m, text in rollouts:
            shared = _score_request("r", text, list(range(1, m + 1)), [text] * m, [text] * m,
                                    ids, "listing", samples, sampling, RenderOptions(),
                                    load_prompt("score"))
            alone = replace(shared, json_schema=score_schema(ids, m))
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
