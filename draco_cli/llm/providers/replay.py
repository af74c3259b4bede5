"""``replay/PATH``: answers only from a recorded call log; anything else is an error (offline
demos, tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draco_cli.errors import InputError
from draco_cli.llm.calllog import AnsweredCalls
from draco_cli.llm.errors import ReplayMiss
from draco_cli.llm.providers.base import Provider
from draco_cli.llm.types import Choice, LLMRequest, Reply, Usage


class ReplayProvider(Provider):
    """Answers only from a recorded call log; anything else is an error (offline demos, tests)."""

    name = "replay"
    supports_n = True

    def __init__(self, path: str, **_: Any) -> None:
        self.model = path
        if not Path(path).exists():
            raise InputError("no such call log (replay/ needs a recorded llm_calls.sqlite)",
                             file=path)
        self.answers = AnsweredCalls(Path(path), "content_hash")

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        choices = []
        for i in samples:
            hit = self.answers.get((req.hash(i, None), i))
            if hit is None:
                raise ReplayMiss(
                    f"replay/{self.model}: no recorded answer for this {req.phase} request "
                    f"(key {req.key!r}, sample {i}): the recorded run asked fewer samples, or "
                    "its prompt, schema, sampling or template version differ from this one")
            choices.append(Choice(text=hit.answer_text, finish="stop"))
        return Reply(choices, Usage(), {"replay": True}, {"replay": True}, 0.0)
