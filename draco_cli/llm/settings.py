"""The LLM settings every LLM stage takes: one typed object, checked when it is made (the
command line's "LLM options" build it, and so does the Python API)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draco_cli.errors import UsageError
from draco_cli.llm.calllog import CallLog
from draco_cli.llm.client import LLMClient
from draco_cli.llm.pool import base_urls
from draco_cli.llm.prices import PriceTable
from draco_cli.llm.providers import STRUCTURED_FORMS


@dataclass
class LLMSettings:
    model: str
    # one URL, several (a fleet, llm/pool.py) or files listing them: kept as one URL or a tuple
    base_url: str | list[str] | tuple[str, ...] | None = None
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
    max_reply_mib: float = 32.0   # the largest reply body a call takes, after decompression

    def __post_init__(self) -> None:
        if self.structured_output not in STRUCTURED_FORMS:
            raise UsageError(f"--structured-output {self.structured_output}: choose from "
                             f"{', '.join(STRUCTURED_FORMS)}")
        if not self.timeout > 0:
            raise UsageError(f"--timeout {self.timeout}: give a positive number of seconds")
        if self.max_cost is not None and not self.max_cost >= 0:
            raise UsageError(f"--max-cost {self.max_cost}: give a budget of 0 USD or more")
        if not self.max_reply_mib > 0 or self.max_reply_mib == float("inf"):
            raise UsageError(f"--max-reply-mib {self.max_reply_mib}: give a positive number of "
                             "MiB (default 32)")
        urls = base_urls(self.base_url)
        self.base_url = None if not urls else urls[0] if len(urls) == 1 else tuple(urls)

    def client(self, log: CallLog) -> LLMClient:
        return LLMClient(self.model, call_log=log, concurrency=self.concurrency, rpm=self.rpm,
                         tpm=self.tpm, timeout=self.timeout, max_retries=self.max_retries,
                         parse_retries=self.parse_retries, max_cost=self.max_cost,
                         prices=PriceTable.load(self.prices),
                         base_url=tuple(self.base_url) if isinstance(self.base_url, list)
                         else self.base_url,
                         structured_output=self.structured_output, system_role=self.system_role,
                         use_n=self.use_n, temperature=self.temperature, seed=self.seed,
                         adaptive=self.adaptive,
                         max_reply_bytes=int(self.max_reply_mib * 2**20))


def check_samples(samples: int, temperature: float | None, use_n: bool = True) -> None:
    """Refuse k > 1 samples asked with ``n`` at temperature 0 before any call: vLLM rejects
    ``n > 1`` under greedy sampling (HTTP 400 at the first call). With ``--no-use-n`` each
    sample is its own call, which any server takes."""
    if samples > 1 and temperature == 0 and use_n:
        raise UsageError(f"--samples {samples} at --temperature 0 asks for n = {samples} under "
                         "greedy sampling, which vLLM refuses (and which gives one answer k "
                         "times): use a temperature above 0, or --samples 1 (--no-use-n asks "
                         "each sample on its own, and pays k times for what a greedy server "
                         "answers alike)")
