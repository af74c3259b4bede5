"""Requests, replies and answers of the LLM layer."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, astuple, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from draco_cli.llm.errors import ReplyRefused

Status = Literal["ok", "unanswered", "skipped"]


@dataclass(frozen=True)
class Sampling:
    """Everything about generation that changes the answer (and so enters the cache key)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = 4096
    thinking: bool = False
    seed: int | None = None


@dataclass
class LLMRequest:
    """One prompt asking for ``samples`` answers that validate against ``answer_model``.

    Put the stable part of the prompt first (instructions, rubric), the varying part last, so
    provider prompt caches hit. ``json_schema`` is the schema sent to the provider (default:
    the answer model's); it may be tighter than the model (enums of valid ids).
    """

    phase: str
    messages: list[dict[str, str]]
    answer_model: type[BaseModel]
    json_schema: dict[str, Any] | None = None
    schema_name: str = "answer"
    samples: int = 1
    sampling: Sampling = field(default_factory=Sampling)
    template_version: str = ""
    key: str = ""  # the caller's label for the log (e.g. a rollout id)
    # What a schema cannot say (docs/llm.md, "Structured answers"): the reason an answer that
    # validated against ``answer_model`` is still wrong, or None. Not part of the cache key.
    check: Callable[[BaseModel], str | None] | None = None
    # Where the heads of the first user message that other calls share end, ascending: the
    # group's (task context and task: every call about the group) and the rollout's (its
    # rubric call, judge samples, re-asks and its group's union call). Providers with explicit
    # prompt caching (Anthropic's cache_control) mark them. Not part of the cache key (the
    # messages are).
    cache_marks: tuple[int, ...] = ()

    @property
    def cache_prefix(self) -> int:
        """Characters of the longest shared head (0: none)."""
        return self.cache_marks[-1] if self.cache_marks else 0

    def problem(self, value: BaseModel) -> str | None:
        return self.check(value) if self.check is not None else None

    def schema(self) -> dict[str, Any]:
        return self.json_schema if self.json_schema is not None else \
            _model_schema(self.answer_model)

    def messages_json(self) -> str:
        """The messages as compact JSON with sorted keys, made once per request: the cache
        keys hash it and the OpenAI-compatible provider splices it into the body it sends."""
        text = self.__dict__.get("_messages_json")
        if text is None:
            text = self.__dict__["_messages_json"] = _dumps(self.messages)
        return text

    def hash(self, sample: int, model: str | None) -> str:
        """Cache key (what enters it: docs/llm.md, "The call log"). ``model=None`` gives the
        content hash used by replay (any recorded model).

        The hashed text is ``json.dumps`` of {model, messages, schema, sampling, template,
        sample} with sorted keys, compact: keys logged by earlier versions stay valid. A call
        asks for its hashes several times, so the parts that do not depend on the sample and
        model (the messages, first in key order, and the rest after them) are made once per
        request."""
        head = self.__dict__.get("_head_hash")
        if head is None:
            head = self.__dict__["_head_hash"] = hashlib.sha256(
                ('{"messages":' + self.messages_json()).encode())
        tail = self.__dict__.get("_tail")
        if tail is None:
            tail = self.__dict__["_tail"] = (
                ',"sampling":' + _dumps(asdict(self.sampling)) + ',"schema":'
                + _dumps(self.schema()) + ',"template":' + _dumps(self.template_version) + "}")
        h = head.copy()
        h.update((',"model":' + _dumps(model) + ',"sample":' + _dumps(sample) + tail).encode())
        return h.hexdigest()


# json.dumps with arguments builds an encoder per call; this one is built once (same output)
_dumps = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode


@functools.lru_cache(maxsize=256)
def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    return strict_schema(model.model_json_schema())


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Make a pydantic JSON schema acceptable to strict structured-output modes: every object
    closed (additionalProperties false) with every property required."""
    schema = json.loads(json.dumps(schema))

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node["additionalProperties"] = False
                node["required"] = list(node["properties"])
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(schema)
    return schema


@dataclass
class Usage:
    """Tokens of one HTTP call, normalised across providers: ``input_tokens`` excludes cached
    and cache-write tokens; ``output_tokens`` includes ``reasoning_tokens``."""

    input_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def scaled(self, share: float) -> Usage:
        return Usage(*(round(a * share) for a in astuple(self)))


# More tokens than this in one reply is a server fault, never a bill (no model's context holds
# a hundredth of it).
MAX_REPLY_TOKENS = 100_000_000


def token_count(name: str, value: object) -> int:
    """A token count a reply reports (``name`` as the reply spells it; absent: 0), or
    ``ReplyRefused`` when it cannot be one: negative, not a whole number, or absurd."""
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_REPLY_TOKENS:
        raise ReplyRefused(f"reply not used: the server reported {name} = {str(value)[:40]}, "
                           "not a possible token count (its answer and cost are not counted)")
    return value


def counts(body: object, *path: str) -> dict[str, Any]:
    """The object at ``path`` in a reply (absent or null: empty); anything else than an
    object is a reply that cannot be counted (``ReplyRefused``)."""
    for key in path:
        body = body.get(key) if isinstance(body, dict) else body
        if body is None:
            return {}
        if not isinstance(body, dict):
            raise ReplyRefused(f"reply not used: its {'.'.join(path)} is not an object")
    return body if isinstance(body, dict) else {}


@dataclass
class Choice:
    """One generated answer: its text, and why generation stopped."""

    text: str | None
    finish: str  # "stop", "length", "refusal", "content_filter", ...
    refusal: str | None = None


@dataclass
class Reply:
    choices: list[Choice]
    usage: Usage
    request_body: dict[str, Any]
    response_body: dict[str, Any]
    latency_s: float = 0.0
    batch_id: str | None = None  # answered through a batch API (billed at the batch price)
    endpoint: str | None = None  # the base URL that answered, when several serve the model
    request_text: str | None = None  # request_body as the JSON sent, when it was serialised
    response_text: str | None = None  # response_body as the JSON received, when it was kept


@dataclass
class Answer:
    sample: int
    status: Status
    value: BaseModel | None = None
    reason: str | None = None
    text: str | None = None
    usage: Usage = field(default_factory=Usage)
    cost_usd: float = 0.0
    attempts: int = 0
    cached: bool = False


@dataclass
class PhaseStats:
    calls: int = 0            # HTTP calls made (every attempt, re-asks included)
    cached: int = 0           # samples answered from the call log
    answered: int = 0
    unanswered: int = 0
    skipped: int = 0          # not asked: budget reached
    failed_attempts: int = 0  # HTTP attempts that failed and were retried
    usage: Usage = field(default_factory=Usage)
    cost_usd: float = 0.0
    priced: bool = True       # False: the model is not in the price table (cost unknown)


@dataclass
class Progress:
    done: int
    total: int
    failed: int
    cost_usd: float
    note: str | None = None   # what a long wait is waiting for (a submitted batch)
    priced: bool = True       # False: cost_usd is unknown (the model has no price), not $0


class RequestStream:
    """Requests yielded by a producer as it builds them; iterable once. ``samples``: the
    answers they ask in all (known up front, for progress)."""

    def __init__(self, requests: Iterator[LLMRequest], samples: int) -> None:
        self._requests, self.samples = requests, samples

    def __iter__(self) -> Iterator[LLMRequest]:
        return self._requests
