"""One stage body for both the blocking CLI path and the async in-loop API.

A stage that asks the LLM is written as a generator: it yields each list of requests it needs
answered and receives the answers back, then returns its result. ``drive`` answers with the
blocking ``client.run``; ``adrive`` with ``await client.arun``, so many groups can be in flight
on one event loop while the stage's logic exists once.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

from draco_cli.llm.types import Answer, LLMRequest

T = TypeVar("T")
Stage = Generator[list[LLMRequest], list[list[Answer]], T]


def drive(stage: Stage[T], client: Any, *, progress=None, batch: bool = False) -> T:
    try:
        requests = next(stage)
        while True:
            requests = stage.send(client.run(requests, progress=progress, batch=batch))
    except StopIteration as stop:
        return stop.value


async def adrive(stage: Stage[T], client: Any, *, progress=None) -> T:
    try:
        requests = next(stage)
        while True:
            requests = stage.send(await client.arun(requests, progress=progress))
    except StopIteration as stop:
        return stop.value
