"""A stage's one "answered" figure, said in these words everywhere (docs/decisions.md, "One
answered figure per stage")."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draco_cli.llm.types import PhaseStats


@dataclass(frozen=True)
class Answered:
    answered: int
    requests: int
    unit: str = "requests"

    @classmethod
    def of(cls, phases: Iterable[PhaseStats]) -> Answered:
        """From a client's phase statistics: reused (``cached``) and new answers over every
        sample asked, left unanswered or not asked for the budget."""
        ok = needed = 0
        for s in phases:
            ok += s.cached + s.answered
            needed += s.cached + s.answered + s.unanswered + s.skipped
        return cls(ok, needed)

    @property
    def share(self) -> float:
        return self.answered / self.requests if self.requests else 1.0

    @property
    def percent(self) -> str:
        # rounded down: 99.6% answered must not read "100%", nor 89.9% read as a 90% threshold
        return f"{100 * self.answered // self.requests}%" if self.requests else "100%"

    def __str__(self) -> str:
        return f"answered {self.answered} of {self.requests} {self.unit} ({self.percent})"


def money(cost_usd: float | None, priced: bool = True, places: int = 4) -> str:
    """Dollars as every summary prints them; an unpriced model's cost is unknown, not $0."""
    if cost_usd is None or not priced:
        return "unpriced"
    return f"${cost_usd:.{places}f}"
