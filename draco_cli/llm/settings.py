"""The LLM settings every LLM stage takes (one place, so every command spells them alike)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draco_cli.llm.calllog import CallLog
from draco_cli.llm.client import LLMClient
from draco_cli.llm.prices import PriceTable


@dataclass
class LLMSettings:
    model: str
    base_url: str | tuple[str, ...] | None = None   # several: a fleet (llm/pool.py)
    concurrency: int = 16
    rpm: float | None = None
    tpm: float | None = None
    timeout: float = 120.0
    max_retries: int = 6
    parse_retries: int = 2
    max_cost: float | None = None
    prices: Path | None = None
    batch: bool | None = None    # None: batch where LLMClient.batches_by_default says
    thinking: bool = False
    structured_output: str = "auto"
    system_role: bool = True      # False: fold system instructions into the first user message
    use_n: bool = True
    temperature: float | None = None
    seed: int | None = None
    adaptive: bool | None = None  # None: on for self-hosted servers (--base-url)

    def client(self, log: CallLog) -> LLMClient:
        return LLMClient(self.model, call_log=log, concurrency=self.concurrency, rpm=self.rpm,
                         tpm=self.tpm, timeout=self.timeout, max_retries=self.max_retries,
                         parse_retries=self.parse_retries, max_cost=self.max_cost,
                         prices=PriceTable.load(self.prices),
                         base_url=self.base_url,
                         structured_output=self.structured_output, system_role=self.system_role,
                         use_n=self.use_n, temperature=self.temperature, seed=self.seed,
                         adaptive=self.adaptive)
