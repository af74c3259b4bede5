"""The call-log rows a client writes (docs/llm.md, "The call log"); text that might hold a key
is scrubbed on the way in."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel

from draco_cli.llm.calllog import CallLog
from draco_cli.llm.keys import scrub
from draco_cli.llm.types import Choice, LLMRequest, Reply


@dataclass
class Rows:
    log: CallLog
    provider: str
    model: str
    priced: bool   # False: costs are unknown (NULL), not $0

    def answer(self, req: LLMRequest, sample: int, attempt: int, status: str,
               error: str | None, reply: Reply, choice: Choice, value: BaseModel | None,
               share: float, cost: float) -> None:
        """A call that answered n samples at once is split evenly over its n rows (``share``),
        so the rows sum to what was billed."""
        u = reply.usage if share == 1.0 else reply.usage.scaled(share)   # read only here
        self.log.record(
            request_hash=req.hash(sample, self.model), content_hash=req.hash(sample, None),
            sample=sample, phase=req.phase, key=req.key, provider=self.provider,
            model=self.model, attempt=attempt, status=status, error=scrub(error),
            request=logged(reply, "request_body"), response=logged(reply, "response_body"),
            answer_text=choice.text,
            parsed=value.model_dump_json() if value is not None else None,
            input_tokens=u.input_tokens, cached_tokens=u.cached_tokens,
            cache_write_tokens=u.cache_write_tokens, output_tokens=u.output_tokens,
            reasoning_tokens=u.reasoning_tokens, latency_s=reply.latency_s,
            cost_usd=cost if self.priced else None, batch_id=reply.batch_id,
            endpoint=reply.endpoint,
        )

    def unanswered(self, req: LLMRequest, sample: int, attempt: int, reason: str | None) -> None:
        self.log.record(request_hash=req.hash(sample, self.model),
                        content_hash=req.hash(sample, None), sample=sample, phase=req.phase,
                        key=req.key, provider=self.provider, model=self.model,
                        attempt=attempt, status="unanswered", error=scrub(reason),
                        cost_usd=0.0 if self.priced else None)

    def failure(self, req: LLMRequest, samples: list[int], attempt: int, error: str,
                response: str | None = None, endpoint: str | None = None) -> None:
        self.log.record(request_hash=req.hash(samples[0], self.model),
                        content_hash=req.hash(samples[0], None), sample=None,
                        phase=req.phase, key=req.key, provider=self.provider,
                        model=self.model, attempt=attempt, status="http_error",
                        error=scrub(error), response=response, endpoint=endpoint,
                        cost_usd=0.0 if self.priced else None)


def logged(reply: Reply, which: str) -> str | None:
    """The scrubbed JSON of a call's request or response, made once per HTTP call (a call
    answering n samples writes n rows; long prompts make this the costly part)."""
    cache: dict[str, str | None] = reply.__dict__.setdefault("_logged", {})
    if which not in cache:
        text = reply.request_text if which == "request_body" else reply.response_text
        if text is None:
            text = json.dumps(getattr(reply, which), ensure_ascii=False)
        cache[which] = scrub(text)
    return cache[which]
