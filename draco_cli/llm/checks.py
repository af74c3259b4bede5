"""``draco llm check``: one tiny structured request, to test a model setup before paying."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from draco_cli.llm.calllog import CallLog
from draco_cli.llm.client import LLMClient
from draco_cli.llm.types import LLMRequest, Sampling


class Pong(BaseModel):
    answer: Literal["pong"]
    steps: list[int]


@dataclass
class CheckResult:
    ok: bool
    detail: str
    latency_s: float
    cost_usd: float

    def summary(self) -> str:
        head = "[green]ok[/]" if self.ok else "[red]failed[/]"
        return f"{head}: {self.detail} ({self.latency_s:.2f} s, ${self.cost_usd:.6f})"


def run_check(model: str, base_url: str | None, timeout: float, log_path: Path) -> CheckResult:
    req = LLMRequest(
        phase="check", answer_model=Pong, sampling=Sampling(max_tokens=256, temperature=0.0),
        messages=[{"role": "system", "content": "Answer with JSON only."},
                  {"role": "user", "content": 'Reply {"answer": "pong", "steps": [1, 2]}.'}])
    with CallLog(log_path) as log:
        client = LLMClient(model, call_log=log, base_url=base_url, timeout=timeout,
                           max_retries=1, parse_retries=0)
        t0 = time.perf_counter()
        [[answer]] = client.run([req])
        latency = time.perf_counter() - t0
    if answer.status == "ok":
        return CheckResult(True, f"{model} answered valid JSON for the schema", latency,
                           answer.cost_usd)
    return CheckResult(False, f"{model}: {answer.reason}", latency, answer.cost_usd)
