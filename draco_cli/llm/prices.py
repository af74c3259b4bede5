"""Dollar cost of calls from normalised usage and a dated price table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from draco_cli.errors import InputError
from draco_cli.llm.types import Usage


@dataclass(frozen=True)
class Price:
    input: float
    cached_input: float
    output: float
    cache_write: float | None = None


class PriceTable:
    """USD per million tokens per ``provider/model``; a model missing from the table costs 0
    and is reported as unpriced (self-hosted models usually are)."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.as_of = data.get("as_of")
        self.batch_discount = float(data.get("batch_discount", 0.5))
        self.models: dict[str, Price] = {}
        for name, p in data.get("models", {}).items():
            try:
                self.models[name] = Price(float(p["input"]), float(p.get("cached_input", p["input"])),
                                          float(p["output"]), p.get("cache_write"))
            except (KeyError, TypeError, ValueError) as exc:
                raise InputError(f"bad price entry ({exc})", file=source, field=f"models.{name}") \
                    from None
            got = self.models[name]
            if min(got.input, got.cached_input, got.output, float(got.cache_write or 0)) < 0:
                raise InputError("a negative price (a call would lower the --max-cost total)",
                                 file=source, field=f"models.{name}")

    @classmethod
    def load(cls, path: str | Path | None = None) -> PriceTable:
        if path is None:
            text = resources.files("draco_cli.llm").joinpath("prices.json").read_text()
            return cls(json.loads(text), "draco_cli/llm/prices.json")
        p = Path(path)
        if not p.exists():
            raise InputError("no such price file", file=str(p))
        try:
            return cls(json.loads(p.read_text()), str(p))
        except json.JSONDecodeError as exc:
            raise InputError(f"not JSON ({exc.msg})", file=str(p)) from None

    def price(self, model_id: str) -> Price | None:
        if model_id in self.models:
            return self.models[model_id]
        # dated snapshots (gpt-4.1-2025-04-14, claude-sonnet-4-5-20250929) fall back to the base
        for name in sorted(self.models, key=len, reverse=True):
            if model_id.startswith(name + "-"):
                return self.models[name]
        return None

    def cost(self, model_id: str, usage: Usage, batch: bool = False) -> float:
        p = self.price(model_id)
        if p is None:
            return 0.0
        write = p.cache_write if p.cache_write is not None else p.input
        usd = (usage.input_tokens * p.input + usage.cached_tokens * p.cached_input
               + usage.cache_write_tokens * write + usage.output_tokens * p.output) / 1e6
        return usd * (self.batch_discount if batch else 1.0)
