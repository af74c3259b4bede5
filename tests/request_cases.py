"""Request bodies of every structured-output form, as the OpenAI-compatible provider sends them:
``wire_texts()`` → {case: SHA-256 of the JSON text sent}. ``tests/request_bytes.json`` holds
them as made by the provider's code before its per-request caches were removed (c0e93a6,
``python tests/request_cases.py > tests/request_bytes.json`` run against that tree), so a change
in the bytes sent, or in the cache keys, fails ``test_request_bytes_and_keys_are_pinned``."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os

from pydantic import BaseModel


class Verdict(BaseModel):
    verdict: str
    reason: str


def _requests():
    from draco_cli.llm.types import LLMRequest, Sampling

    messages = [{"role": "system", "content": "Judge the rollout. Ünïcode ✓"},
                {"role": "user", "content": "rollout 1\nstep 1: ls"}]
    schema = {"type": "object", "properties": {"v": {"type": "string", "enum": ["pass", "fail"]}},
              "required": ["v"], "additionalProperties": False}
    samplings = [Sampling(), Sampling(temperature=1), Sampling(temperature=1.0, seed=7),
                 Sampling(temperature=0.0), Sampling(temperature=-0.0, top_p=0.9),
                 Sampling(thinking=True, max_tokens=64)]
    for (k, s), explicit in itertools.product(enumerate(samplings), (False, True)):
        yield f"s{k}-{'explicit' if explicit else 'model'}", LLMRequest(
            phase="score", key="r1", answer_model=Verdict, messages=messages,
            json_schema=schema if explicit else None, schema_name="verdicts", sampling=s,
            template_version="score.v1")


def wire_texts() -> dict[str, str]:
    from draco_cli.llm.providers.openai import OpenAIProvider

    os.environ.setdefault("OPENAI_API_KEY", "sk-test-local-only")
    out: dict[str, str] = {}
    forms = ["auto", "json-schema", "json-schema-loose", "json-object", "vllm", "prompt"]
    for base_url, form, system_role in itertools.product(
            (None, "http://127.0.0.1:9/v1"), forms, (True, False)):
        p = OpenAIProvider("m", base_url=base_url, concurrency=2, timeout=5,
                           structured_output=form, system_role=system_role)
        where = "self-hosted" if base_url else "hosted"
        for name, r in _requests():
            for n in (1, 3):
                text = p.wire(r, r.messages, n)[1]
                key = f"{where}/{form}/{'system' if system_role else 'fold'}/{name}/n{n}"
                out[key] = hashlib.sha256(text.encode()).hexdigest()
        asyncio.run(p.close())
    for name, r in _requests():
        for sample, model in itertools.product((0, 1), ("m", None)):
            out[f"hash/{name}/{sample}/{model}"] = r.hash(sample, model)
    return out


if __name__ == "__main__":
    print(json.dumps(wire_texts(), indent=1, sort_keys=True))
