"""One stage body for both the blocking CLI path and the async in-loop API.

A stage that asks the LLM is written as a generator: it yields each list of requests it needs
answered and receives the answers back, then returns its result. ``drive`` answers with the
blocking ``client.run``; ``adrive`` with ``await client.arun``, so many groups can be in flight
on one event loop while the stage's logic exists once.

A stage may yield a ``RequestStream`` instead of a list: requests built one at a time while the
client is already answering the first ones (a producer feeding the client, not a serial pre-pass
over every prompt). A client that takes streams says so (``streams = True``); any other gets the
stream as a list.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from draco_cli.llm.types import Answer, LLMRequest

if TYPE_CHECKING:  # client.py imports this module
    from draco_cli.llm.client import Progress

T = TypeVar("T")


class RequestStream:
    """Requests yielded by a producer as it builds them; iterable once. ``count`` requests
    asking ``samples`` answers in all (known up front, for progress)."""

    def __init__(self, requests: Iterator[LLMRequest], count: int, samples: int) -> None:
        self._requests = requests
        self.count, self.samples = count, samples

    def __iter__(self) -> Iterator[LLMRequest]:
        return self._requests

    def __len__(self) -> int:
        return self.count


Stage = Generator["list[LLMRequest] | RequestStream", list[list[Answer]], T]


def _for(client: Any, requests: Iterable[LLMRequest]) -> Iterable[LLMRequest]:
    if isinstance(requests, RequestStream) and not getattr(client, "streams", False):
        return list(requests)
    return requests


def drive(stage: Stage[T], client: Any, *,
          progress: Callable[[Progress], None] | None = None, batch: bool | None = False) -> T:
    try:
        requests = next(stage)
        while True:
            requests = stage.send(client.run(_for(client, requests), progress=progress,
                                             batch=batch))
    except StopIteration as stop:
        result: T = stop.value   # the generator's return value (StopIteration types it Any)
        return result


async def adrive(stage: Stage[T], client: Any, *,
                 progress: Callable[[Progress], None] | None = None) -> T:
    try:
        requests = next(stage)
        while True:
            requests = stage.send(await client.arun(_for(client, requests), progress=progress))
    except StopIteration as stop:
        result: T = stop.value   # the generator's return value (StopIteration types it Any)
        return result
