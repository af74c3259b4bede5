"""``draco llm check``: probe a model setup before paying for a run.

It sends a handful of tiny requests and reports what the server takes, with the options to use:
- which structured-output form it accepts and answers validly (a form the server rejects, or
  ignores so that the answer does not validate, is reported with the server's own reason);
- whether it honours ``n`` (several choices in one call) or returns one;
- whether its chat format keeps the system role: the same question is sent with and without a
  long system message, and a prompt-token count that does not grow means the system message was
  dropped (Gemma's template in llama.cpp), so ``--system-role fold`` is advised;
- its useful parallelism: 1, 2, 4 and 8 requests at once; throughput stops rising where the
  server queues instead of batching, and ``--concurrency`` is advised at that level.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from draco_cli.llm.errors import LLMError, Retryable
from draco_cli.llm.keys import scrub
from draco_cli.llm.providers import (ANTHROPIC_FORMS, OPENAI_FORMS, Provider, make_provider,
                                     parse_model_id)
from draco_cli.llm.types import LLMRequest, Reply, Sampling


class Pong(BaseModel):
    answer: Literal["pong"]
    steps: list[int]


# Preference order: the tightest constraint a server takes first.
OPENAI_ORDER = ("json-schema", "json-object", "vllm", "json-schema-loose", "prompt")
ANTHROPIC_ORDER = ("output-format", "tool", "prompt")
assert set(OPENAI_ORDER) == set(OPENAI_FORMS) and set(ANTHROPIC_ORDER) == set(ANTHROPIC_FORMS)


@dataclass
class Finding:
    what: str
    ok: bool
    detail: str


@dataclass
class CheckResult:
    ok: bool
    detail: str
    latency_s: float
    cost_usd: float | None
    findings: list[Finding] = field(default_factory=list)
    advice: dict[str, str] = field(default_factory=dict)

    def options(self) -> str:
        return " ".join(f"{k} {v}" if v else k for k, v in self.advice.items())

    def summary(self) -> str:
        head = "[green]ok[/]" if self.ok else "[red]failed[/]"
        cost = "unpriced" if self.cost_usd is None else f"${self.cost_usd:.6f}"
        return f"{head}: {self.detail} ({self.latency_s:.2f} s, {cost})"


def _request(max_tokens: int, temperature: float | None, seed: int | None,
             system: str | None = "Answer with JSON only.") -> LLMRequest:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": 'Reply {"answer": "pong", "steps": [1, 2]}.'})
    return LLMRequest(phase="check", answer_model=Pong, schema_name="pong",
                      sampling=Sampling(max_tokens=max_tokens, temperature=temperature,
                                        seed=seed), messages=messages)


def _validates(reply: Reply) -> tuple[bool, str]:
    if not reply.choices:
        return False, "no choice in the reply"
    c = reply.choices[0]
    if c.finish == "length":
        return False, "truncated at max_tokens: raise --max-tokens"
    try:
        Pong.model_validate_json(c.text or "")
        return True, "valid answer"
    except ValidationError as exc:
        errors = exc.errors()
        why = errors[0]["msg"] if errors else "invalid"
        return False, f"answer does not validate ({why}): " \
            f"{scrub((c.text or '')[:120])!r}"


async def _one(provider: Provider, req: LLMRequest, n: int = 1) -> tuple[Reply | None, str]:
    try:
        return await provider.complete(req, req.messages, list(range(n))), ""
    except (Retryable, LLMError) as exc:
        return None, scrub(str(exc)) or "error"


# A failure no other structured-output form can get past: stop probing forms at once.
_FATAL = ("connection refused", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HTTP 401", "HTTP 404")


async def _pick_form(model: str, forms: list[str], base_url: str | None, timeout: float,
                     req: LLMRequest, findings: list[Finding]) -> tuple[str | None, str | None]:
    """(the first form that gives a valid answer, or None; the error that ended probing early,
    or None)."""
    for f in forms:
        provider = make_provider(model, base_url=base_url, timeout=timeout, concurrency=8,
                                 structured_output=f)
        try:
            reply, err = await _one(provider, req)
            if reply is None:
                findings.append(Finding(f"form {f}", False, f"rejected: {err}"))
                if any(fatal in err for fatal in _FATAL):
                    return None, err
                continue
            ok, why = _validates(reply)
            findings.append(Finding(f"form {f}", ok, why))
            if ok:
                return f, None
        finally:
            await provider.close()
    return None, None


async def _check_n(provider: Provider, req: LLMRequest, findings: list[Finding],
                   advice: dict[str, str]) -> None:
    reply, err = await _one(provider, req, 2)
    got = len(reply.choices) if reply else 0
    honoured = got == 2
    findings.append(Finding("n = 2", honoured, f"{got} choice(s) returned" +
                            ("" if reply else f": {err}")))
    if not honoured:
        advice["--no-use-n"] = ""


async def _check_system_role(provider: Provider, temperature: float | None, seed: int | None,
                             findings: list[Finding], advice: dict[str, str]) -> None:
    """Does a long system message reach the prompt at all? Only the prompt token counts
    matter, so the answers may stop after a few tokens."""
    filler = "Context for the reply. " * 40
    bare, _ = await _one(provider, _request(8, temperature, seed, None))
    with_sys, _ = await _one(provider, _request(8, temperature, seed, filler))
    if bare is None or with_sys is None:
        return
    a = bare.usage.input_tokens + bare.usage.cached_tokens
    b = with_sys.usage.input_tokens + with_sys.usage.cached_tokens
    if a or b:
        kept = b - a >= 40
        findings.append(Finding("system role", kept,
                                f"prompt tokens {a} without, {b} with a ~200-token "
                                "system message" + ("" if kept else
                                                    ": the chat format drops it")))
        if not kept:
            advice["--system-role"] = "fold"


async def _check_parallelism(provider: Provider, max_tokens: int, temperature: float | None,
                             seed: int | None, findings: list[Finding],
                             advice: dict[str, str]) -> None:
    best, rates = 1, dict[int, float]()
    short = _request(min(max_tokens, 32), temperature, seed)
    # untimed: a server's first sight of a prompt costs more (prompt cache, warm-up), and
    # charged to "1 at once" alone it would make any parallelism look like a gain
    await _one(provider, short)

    async def timed() -> float | None:
        t = time.perf_counter()
        reply, _ = await _one(provider, short)
        return None if reply is None else time.perf_counter() - t

    for c in (1, 2, 4, 8):
        start = time.perf_counter()
        latencies = await asyncio.gather(*(timed() for _ in range(c)))
        wall = time.perf_counter() - start
        if any(t is None for t in latencies):
            break
        rates[c] = c / wall
        if c > 1 and rates[c] < rates[best] * 1.25:
            break  # latency rose, throughput did not: the server queues
        # Calls sent together that end one after another (the last taking c times the first's
        # time) were queued, whatever the rate: on a busy machine one round's rate against
        # another's is noise, the spread within a round is not (its calls share the noise).
        done = sorted(t for t in latencies if t is not None)
        if c > 1 and done[-1] >= done[0] * (1 + (c - 1) / 2):
            break
        best = c
    findings.append(Finding("parallelism", True, ", ".join(
        f"{c} at once: {r:.2f} calls/s" for c, r in rates.items())))
    advice["--concurrency"] = str(best if best < 8 else 16)


async def _probe(model: str, base_url: str | None, timeout: float, max_tokens: int,
                 temperature: float | None, seed: int | None, form: str | None,
                 parallelism: bool) -> CheckResult:
    provider_name, _ = parse_model_id(model)
    findings: list[Finding] = []
    req = _request(max_tokens, temperature, seed)
    t0 = time.perf_counter()
    cost = 0.0
    if provider_name == "replay":
        provider = make_provider(model)
        reply, err = await _one(provider, req)
        ok = reply is not None and _validates(reply)[0]
        return CheckResult(ok, f"{model}: {'replays' if ok else err or 'no answer'}",
                           time.perf_counter() - t0, 0.0)
    order = ANTHROPIC_ORDER if provider_name == "anthropic" else OPENAI_ORDER
    forms = [form] if form and form != "auto" else list(order)
    chosen, fatal = await _pick_form(model, forms, base_url, timeout, req, findings)
    if fatal is not None:
        return CheckResult(False, fatal, time.perf_counter() - t0, None, findings)
    if chosen is None:
        return CheckResult(False, f"{model}: no structured-output form gave a valid answer "
                           "(see the findings)", time.perf_counter() - t0, None, findings)
    advice = {"--structured-output": chosen}
    provider = make_provider(model, base_url=base_url, timeout=timeout, concurrency=8,
                             structured_output=chosen)
    try:
        if provider.supports_n:
            await _check_n(provider, req, findings, advice)
        await _check_system_role(provider, temperature, seed, findings, advice)
        if parallelism:
            await _check_parallelism(provider, max_tokens, temperature, seed, findings, advice)
    finally:
        await provider.close()
    from draco_cli.llm.prices import PriceTable

    priced = PriceTable.load().price(model) is not None
    return CheckResult(True, f"{model} answered valid JSON for the schema with "
                       f"--structured-output {chosen}", time.perf_counter() - t0,
                       cost if priced else None, findings, advice)


def run_check(model: str, base_url: str | None, timeout: float, log_path: Path | None = None,
              *, max_tokens: int = 256, temperature: float | None = 0.0,
              seed: int | None = None, form: str | None = None,
              parallelism: bool = True) -> CheckResult:
    """Probe ``model`` (see the module doc). ``log_path`` is kept for compatibility: probes are
    diagnostics and are not written to a call log."""
    return asyncio.run(_probe(model, base_url, timeout, max_tokens, temperature, seed, form,
                              parallelism))
