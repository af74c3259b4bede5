"""The judge's score requests hash as documented, and every form of request body is sent as the
same bytes, under the same cache keys, as before the LLM layer's per-request caches went
(``tests/request_cases.py``, ``tests/request_bytes.json``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.judge.core import _score_request
from draco_cli.llm.types import LLMRequest, Sampling
from draco_cli.prompts import load_prompt
from draco_cli.prompts.render import RenderOptions
from tests.conftest import REPO, examples


def documented_hash(r: LLMRequest, sample: int, model: str | None) -> str:
    payload = {"model": model, "messages": r.messages, "schema": r.schema(),
               "sampling": asdict(r.sampling), "template": r.template_version, "sample": sample}
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


ids_ = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4, unique=True)


@settings(max_examples=examples(40), deadline=None)
@given(ids_, st.integers(0, 4), st.text(max_size=20),
       st.one_of(st.none(), st.floats(0, 2)), st.integers(1, 3))
def test_judge_requests_hash_as_documented(ids, m, text, temp, samples):
    r = _score_request("r", text, list(range(1, m + 1)), [text] * m, [text] * m, ids,
                       "listing", samples, Sampling(temperature=temp), RenderOptions(),
                       load_prompt("score"))
    for sample in range(samples):
        for model in ("m", None):
            assert r.hash(sample, model) == documented_hash(r, sample, model)


def test_request_bytes_and_keys_are_pinned(monkeypatch):
    from tests.request_cases import wire_texts

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-local-only")
    expected = json.loads((REPO / "tests" / "request_bytes.json").read_text())
    got = wire_texts()
    assert got.keys() == expected.keys()
    assert [k for k in got if got[k] != expected[k]] == []
