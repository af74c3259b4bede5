"""One stage body for both the blocking CLI path and the async in-loop API: a stage is a
generator that yields request lists (or a ``RequestStream``) and receives the answers;
``drive`` answers with ``client.run``, ``adrive`` with ``await client.arun``. See
docs/decisions.md, "Stages written once, driven two ways" and "Streams are opt-in per client".
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Protocol, TypeVar

from draco_cli.llm.client import LLMClient
from draco_cli.llm.types import Answer, LLMRequest, Progress, RequestStream

T = TypeVar("T")

Stage = Generator["list[LLMRequest] | RequestStream", list[list[Answer]], T]


class AsyncClient(Protocol):
    """What ``adrive`` answers a stage with: ``LLMClient``, or a wrapper of one."""

    async def arun(self, requests: list[LLMRequest],
                   progress: Callable[[Progress], None] | None = None) -> list[list[Answer]]: ...


def drive(stage: Stage[T], client: LLMClient, *,
          progress: Callable[[Progress], None] | None = None, batch: bool | None = False) -> T:
    try:
        requests = next(stage)
        while True:
            answers = client.run(requests, progress=progress, batch=batch)
            requests = stage.send(answers)
    except StopIteration as stop:
        result: T = stop.value   # the generator's return value (StopIteration types it Any)
        return result


async def adrive(stage: Stage[T], client: AsyncClient, *,
                 progress: Callable[[Progress], None] | None = None) -> T:
    try:
        requests = next(stage)
        while True:
            answers = await client.arun(requests, progress=progress) \
                if isinstance(client, LLMClient) \
                else await client.arun(list(requests), progress=progress)
            requests = stage.send(answers)
    except StopIteration as stop:
        result: T = stop.value   # the generator's return value (StopIteration types it Any)
        return result
