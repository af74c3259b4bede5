"""``draco llm check``: probe a model setup before paying for a run, and print the options
that work for it, the whole line. What it probes and why: see docs/llm.md, "draco llm check".
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from draco_cli.llm.errors import LLMError, Retryable
from draco_cli.llm.keys import scrub
from draco_cli.llm.prices import PriceTable
from draco_cli.llm.providers import Provider, make_provider, parse_model_id, provider_class
from draco_cli.llm.settings import LLMSettings
from draco_cli.llm.types import LLMRequest, Reply, Sampling, Usage
from draco_cli.options import PromptOptions

# The order the advised options are printed in (the rest after them).
ADVICE_ORDER = ("--structured-output", "--system-role", "--no-use-n", "--concurrency",
                "--max-tokens", "--timeout", "--temperature", "--max-prompt-tokens")
# The run's --max-prompt-tokens default (judge score, draco run): checked against the window.
RUN_PROMPT_TOKENS = 24000
# --timeout advised: this many times the time an answer of --max-tokens takes, at least MIN.
TIMEOUT_MARGIN, MIN_TIMEOUT = 1.5, 30

_IDS = ["c1", "c2"]
_ROLLOUT = ("Task: find the capital of France.\n"
            "Step 1: searched the web for 'capital of France'; it returned 'Paris'.\n"
            "Step 2: answered 'Paris'.\n"
            'Criteria (one JSON object per line):\n'
            '{"id": "c1", "title": "Searches before answering"}\n'
            '{"id": "c2", "title": "Answers correctly"}\n'
            "Give exactly one verdict for each criterion id, citing the steps that show it, "
            "with a reason of three words, as JSON: "
            '{"verdicts": [{"criterion_id": "c1", "verdict": "pass", "cited_steps": [1], '
            '"reason": "..."}, {"criterion_id": "c2", ...}]}')


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
        keys = [k for k in ADVICE_ORDER if k in self.advice] + \
            [k for k in self.advice if k not in ADVICE_ORDER]
        return " ".join(f"{k} {self.advice[k]}" if self.advice[k] else k for k in keys)

    def summary(self) -> str:
        head = "[green]ok[/]" if self.ok else "[red]failed[/]"
        cost = "unpriced" if self.cost_usd is None else f"${self.cost_usd:.6f}"
        return f"{head}: {self.detail} ({self.latency_s:.2f} s, {cost})"


def _request(max_tokens: int, temperature: float | None, seed: int | None,
             system: str | None = "You judge agent rollouts. Answer with JSON only."
             ) -> LLMRequest:
    """A judge call in miniature: ``judge.core``'s own schema and after-decoding check."""
    from draco_cli.judge.core import ScoreAnswer, score_schema, verdict_check

    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": _ROLLOUT})
    return LLMRequest(phase="check", answer_model=ScoreAnswer, schema_name="verdicts",
                      json_schema=score_schema(_IDS, 2), check=verdict_check(_IDS),
                      sampling=Sampling(max_tokens=max_tokens, temperature=temperature,
                                        seed=seed), messages=messages)


def _validates(reply: Reply, req: LLMRequest) -> tuple[bool, str | None, str]:
    """(the answer has the schema's shape; what the judge's check finds wrong in it, or None;
    a one-line account)."""
    if not reply.choices:
        return False, None, "no choice in the reply"
    c = reply.choices[0]
    if c.finish == "length":
        return False, None, f"truncated at --max-tokens {req.sampling.max_tokens}: raise it"
    try:
        value = req.answer_model.model_validate_json(c.text or "")
    except ValidationError as exc:
        errors = exc.errors()
        why = errors[0]["msg"] if errors else "invalid"
        return False, None, f"answer does not validate ({why}): " \
            f"{scrub((c.text or '')[:120])!r}"
    problem = req.problem(value)
    if problem is not None:
        return True, problem, f"answer of the schema's shape, but {problem} (a run re-asks " \
            "each such answer: --parse-retries)"
    return True, None, "valid answer"


# The usage of every probe of one check (set by ``_probe``), for the cost it reports.
_SPENT: ContextVar[list[Usage] | None] = ContextVar("draco_check_spent", default=None)


async def _one(provider: Provider, req: LLMRequest, n: int = 1) -> tuple[Reply | None, str]:
    try:
        reply = await provider.complete(req, req.messages, list(range(n)))
    except (Retryable, LLMError) as exc:
        return None, scrub(str(exc)) or "error"
    spent = _SPENT.get()
    if spent is not None:
        spent.append(reply.usage)
    return reply, ""


# A failure no other structured-output form can get past: stop probing forms at once.
_FATAL = ("connection refused", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HTTP 401", "HTTP 404")


async def _pick_form(model: str, forms: list[str], base_url: str | None, timeout: float,
                     req: LLMRequest, findings: list[Finding]
                     ) -> tuple[str | None, Reply | None, str | None]:
    """Every form in ``forms`` is probed (a server may take several, and the findings say
    which). Returns (the tightest form whose answer is valid, else the tightest whose answer
    at least has the schema's shape, else None; that form's reply; the error that ended
    probing early, or None)."""
    clean: tuple[str, Reply] | None = None
    shaped: tuple[str, Reply] | None = None
    for f in forms:
        provider = make_provider(model, base_url=base_url, timeout=timeout, concurrency=8,
                                 structured_output=f)
        try:
            reply, err = await _one(provider, req)
        finally:
            await provider.close()
        if reply is None:
            findings.append(Finding(f"form {f}", False, f"rejected: {err}"))
            if any(fatal in err for fatal in _FATAL):
                return None, None, err
            continue
        shape, problem, why = _validates(reply, req)
        findings.append(Finding(f"form {f}", shape and problem is None, why))
        if shape and problem is None and clean is None:
            clean = (f, reply)
        if shape and shaped is None:
            shaped = (f, reply)
    best = clean or shaped
    return (best[0], best[1], None) if best else (None, None, None)


async def _check_n(provider: Provider, req: LLMRequest, findings: list[Finding],
                   advice: dict[str, str]) -> None:
    if req.sampling.temperature == 0:
        findings.append(Finding("n = 2", True, "not probed at temperature 0: k greedy samples "
                                "are one answer, and vLLM refuses n > 1 under greedy sampling "
                                "(a run refuses --samples k > 1 at --temperature 0); for k "
                                "samples probe at the run's temperature > 0"))
        return
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
                             advice: dict[str, str]) -> dict[int, float]:
    """Calls per second at 1, 2, 4, 8 at once, up to where the server queues."""
    best, rates = 1, dict[int, float]()
    short = _request(min(max_tokens, 32), temperature, seed)
    # untimed: a server's first sight of a prompt costs more (prompt cache, warm-up), and
    # charged to "1 at once" alone it would make any parallelism look like a gain
    await _one(provider, short)

    async def timed() -> float | None:
        t = time.perf_counter()
        reply, _ = await _one(provider, short)
        return None if reply is None else time.perf_counter() - t

    why = "not queued at 8 at once: 16 advised, not measured (a self-hosted run adapts down)"
    for c in (1, 2, 4, 8):
        start = time.perf_counter()
        latencies = await asyncio.gather(*(timed() for _ in range(c)))
        wall = time.perf_counter() - start
        if any(t is None for t in latencies):
            why = f"a call failed at {c} at once"
            break
        rates[c] = c / wall
        if c > 1 and rates[c] < rates[best] * 1.25:
            why = f"{c} at once gained under 25% over {best}"   # latency rose: it queues
            break
        # Calls sent together that end one after another (the last taking c times the first's
        # time) were queued, whatever the rate: on a busy machine one round's rate against
        # another's is noise, the spread within a round is not (its calls share the noise).
        done = sorted(t for t in latencies if t is not None)
        if c > 1 and done[-1] >= done[0] * (1 + (c - 1) / 2):
            why = f"{c} sent at once came back one after another (queued)"
            break
        best = c
    findings.append(Finding("parallelism", True, ", ".join(
        f"{c} at once: {r:.2f} calls/s" for c, r in rates.items()) + f"; {why}"))
    advice["--concurrency"] = str(best if best < 8 else 16)
    return rates


def _rate(*replies: Reply | None) -> tuple[float, Reply] | None:
    """The best tokens/s of ``replies`` (output tokens over the call's wall time, prompt
    included): a server's first sight of a prompt can cost more than a run's calls do."""
    rated = [(r.usage.output_tokens / r.latency_s, r) for r in replies
             if r is not None and r.usage.output_tokens > 0 and r.latency_s > 0]
    return max(rated, key=lambda x: x[0]) if rated else None


def _check_rate(rated: tuple[float, Reply] | None, req: LLMRequest, timeout: float,
                rates: dict[int, float], findings: list[Finding],
                advice: dict[str, str]) -> None:
    """Tokens/s, and a --timeout an answer of --max-tokens fits in at the advised concurrency."""
    max_tokens = req.sampling.max_tokens
    advice["--max-tokens"] = str(max_tokens)
    advice["--timeout"] = f"{timeout:g}"
    if rated is None:
        findings.append(Finding("tokens/s", False, "not measured (the server reported no "
                                "output tokens or no time): --timeout as given"))
        return
    tps, reply = rated
    out = reply.usage.output_tokens
    c = int(advice.get("--concurrency", "1"))
    measured = max((k for k in rates if k <= c), default=1)
    # c calls at once each take (c / rate at c) against (1 / rate at 1) as long as one alone
    slow = measured * rates[1] / rates[measured] if 1 in rates and rates.get(measured) else 1.0
    need = max_tokens / tps * max(slow, 1.0)
    fits = int(max_tokens // max(out / len(_IDS), 1.0))
    detail = (f"{tps:.1f} tokens/s (one answer: {out} tokens in {reply.latency_s:.2f} s, "
              f"prompt included); this {len(_IDS)}-criterion answer took {out} tokens, so "
              f"--max-tokens {max_tokens} holds about {fits} criteria at three-word reasons "
              f"(a run's reasons are longer); an answer of --max-tokens takes ~{need:.0f} s at "
              f"--concurrency {c}")
    fine = timeout >= need * TIMEOUT_MARGIN
    if fine:
        detail += f": --timeout {timeout:g} fits it"
    else:
        advised = max(MIN_TIMEOUT, math.ceil(need * TIMEOUT_MARGIN))
        advice["--timeout"] = str(advised)
        detail += (f", more than --timeout {timeout:g} allows: such an answer would be given up "
                   "(and retried) while a server that does not abort on disconnect "
                   f"(llama-cpp-python) goes on computing it; advised --timeout {advised}, or a "
                   "lower --max-tokens")
    findings.append(Finding("tokens/s", fine, detail))


async def _context_window(base_url: str, timeout: float) -> tuple[int | None, str]:
    """The server's context window, where it reports one: vLLM's ``max_model_len`` in
    /v1/models, llama.cpp's llama-server's ``n_ctx`` in /props. (window or None, source)."""
    import aiohttp

    root = base_url.rstrip("/")
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    bare = root[:-3] if root.endswith("/v1") else root
    wait = aiohttp.ClientTimeout(total=min(timeout, 10.0))
    async with aiohttp.ClientSession(timeout=wait, headers=headers) as session:
        for url, find in ((f"{root}/models", _max_model_len), (f"{bare}/props", _n_ctx)):
            try:
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status != 200:
                        continue
                    window = find(await resp.json(content_type=None))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            if window:
                return window, url[len(bare):]
    return None, ""


def _max_model_len(body: Any) -> int | None:
    data = body.get("data") if isinstance(body, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    value = first.get("max_model_len")
    return value if isinstance(value, int) and value > 0 else None


def _n_ctx(body: Any) -> int | None:
    settings = body.get("default_generation_settings") if isinstance(body, dict) else None
    value = settings.get("n_ctx") if isinstance(settings, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def _check_window(window: int | None, source: str, max_tokens: int, findings: list[Finding],
                  advice: dict[str, str]) -> None:
    if window is None:
        findings.append(Finding("context window", True, "not reported by the server (vLLM "
                                "and llama-server do; llama-cpp-python does not): keep "
                                "--max-prompt-tokens + --max-tokens within it"))
        return
    room = int((window - max_tokens) * 0.9)   # draco counts prompt tokens approximately
    if room < 500:
        findings.append(Finding("context window", False, f"{window} tokens ({source}): "
                                f"--max-tokens {max_tokens} leaves no room for a prompt"))
        return
    fits = RUN_PROMPT_TOKENS + max_tokens <= window
    findings.append(Finding("context window", fits, f"{window} tokens ({source})" + (
        "" if fits else f": the default --max-prompt-tokens {RUN_PROMPT_TOKENS} with "
        f"--max-tokens {max_tokens} overflows it; advised --max-prompt-tokens {room}")))
    if not fits:
        advice["--max-prompt-tokens"] = str(room)


def _temperature_finding(temperature: float | None) -> Finding:
    if temperature is None:
        return Finding("temperature", True, "none sent, as by a run without --temperature: "
                       "the server's default applies (0.8 in llama.cpp, 1.0 in vLLM); pass "
                       "--temperature to probe and run at another")
    return Finding("temperature", True, f"probed at {temperature:g}, as the run will send it")


async def _probe(model: str, base_url: str | None, timeout: float, max_tokens: int,
                 temperature: float | None, seed: int | None, form: str | None,
                 parallelism: bool) -> CheckResult:
    provider_name, _ = parse_model_id(model)
    spent: list[Usage] = []
    _SPENT.set(spent)
    findings = [_temperature_finding(temperature)]
    req = _request(max_tokens, temperature, seed)
    t0 = time.perf_counter()
    if provider_name == "replay":
        provider = make_provider(model)
        reply, err = await _one(provider, req)
        ok = reply is not None and _validates(reply, req)[0]
        return CheckResult(ok, f"{model}: {'replays' if ok else err or 'no answer'}",
                           time.perf_counter() - t0, 0.0)
    # every form the provider takes, tightest first (mock/ takes json-schema only)
    forms = [form] if form and form != "auto" else list(provider_class(provider_name).forms)
    chosen, first, fatal = await _pick_form(model, forms, base_url, timeout, req, findings)
    if fatal is not None:
        return CheckResult(False, fatal, time.perf_counter() - t0, None, findings)
    if chosen is None:
        return CheckResult(False, f"{model}: no structured-output form gave an answer of the "
                           "judge's schema (see the findings)", time.perf_counter() - t0, None,
                           findings)
    advice = {"--structured-output": chosen}
    provider = make_provider(model, base_url=base_url, timeout=timeout, concurrency=8,
                             structured_output=chosen)
    url = base_url or os.environ.get("DRACO_BASE_URL")
    rates: dict[int, float] = {}
    try:
        if provider.supports_n:
            await _check_n(provider, req, findings, advice)
        await _check_system_role(provider, temperature, seed, findings, advice)
        again, _ = await _one(provider, req)   # the form's prompt seen before: warm
        if parallelism:
            rates = await _check_parallelism(provider, max_tokens, temperature, seed,
                                             findings, advice)
        window = await _context_window(url, timeout) \
            if url and provider_name == "openai" else None
    finally:
        await provider.close()
    if provider_name == "mock":   # answers in-process: no rate to measure
        advice.update({"--max-tokens": str(max_tokens), "--timeout": f"{timeout:g}"})
    else:
        _check_rate(_rate(first, again), req, timeout, rates, findings, advice)
    if window is not None:
        _check_window(*window, max_tokens, findings, advice)
    if temperature is not None:
        advice["--temperature"] = f"{temperature:g}"
    prices = PriceTable.load()
    cost = sum(prices.cost(model, u) for u in spent) if prices.price(model) is not None \
        else None
    return CheckResult(True, f"{model} answered valid JSON for the judge's schema with "
                       f"--structured-output {chosen}", time.perf_counter() - t0, cost,
                       findings, advice)


def run_check(model: str, base_url: str | None, timeout: float,
              *, max_tokens: int = 1024, temperature: float | None = None,
              seed: int | None = None, form: str | None = None,
              parallelism: bool = True) -> CheckResult:
    """Probe ``model`` (see docs/llm.md, "draco llm check"). Probes are diagnostics: no call
    log is written. The options are checked as a run checks them, before any request."""
    LLMSettings(model, base_url=base_url, timeout=timeout, temperature=temperature, seed=seed,
                structured_output=form or "auto")
    PromptOptions.build(max_tokens=max_tokens)
    return asyncio.run(_probe(model, base_url, timeout, max_tokens, temperature, seed, form,
                              parallelism))
