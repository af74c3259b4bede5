"""The LLM layer: one async client over OpenAI, Anthropic, OpenAI-compatible servers and
recorded call logs, with caching, retries, validation, cost accounting and budgets."""

from draco_cli.llm.calllog import CallLog
from draco_cli.llm.client import LLMClient
from draco_cli.llm.errors import LLMError, ReplayMiss
from draco_cli.llm.export import export_parquet
from draco_cli.llm.prices import PriceTable
from draco_cli.llm.types import Answer, LLMRequest, PhaseStats, Progress, Sampling, Usage

__all__ = ["Answer", "CallLog", "LLMClient", "LLMError", "LLMRequest", "PhaseStats",
           "PriceTable", "Progress", "ReplayMiss", "Sampling", "Usage", "export_parquet"]
