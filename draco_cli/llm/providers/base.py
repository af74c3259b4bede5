"""What every provider shares: the ``Provider`` interface, the structured-output forms, a
submitted batch's state and the message rewrites some chat formats need."""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any, cast

from draco_cli.llm.errors import LLMError, ModelSpecError
from draco_cli.llm.types import LLMRequest, Reply

# The largest reply body (after decompression) a call takes: --max-reply-mib, default 32 MiB.
DEFAULT_MAX_REPLY_BYTES = 32 * 2**20

# In the order `draco llm check` prefers them: the tightest constraint a server takes first.
OPENAI_FORMS = ("json-schema", "json-object", "vllm", "json-schema-loose", "prompt")
ANTHROPIC_FORMS = ("output-format", "tool", "prompt")
# How a request asks for a JSON answer (``--structured-output``; each form in docs/llm.md).
# Servers differ; `draco llm check` probes which of these a server accepts.
STRUCTURED_FORMS = ("auto", *OPENAI_FORMS, "output-format", "tool")


def split_system(messages: list[dict[str, str]]) -> tuple[str | None, list[dict[str, str]]]:
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    return system, [m for m in messages if m["role"] != "system"]


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """System instructions moved to the head of the first user message, for chat formats that
    drop the system role (Gemma's template, some llama.cpp chat formats)."""
    system, chat = split_system(messages)
    if not system:
        return list(messages)
    chat = [dict(m) for m in chat]
    for m in chat:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            return chat
    return [{"role": "user", "content": system}] + chat


def schema_instruction(schema: dict[str, Any]) -> str:
    """For servers that constrain nothing: the schema, stated in the prompt (``prompt_schema``:
    the prompt form pays for it on every call, after the cached head)."""
    closed = _all_closed(schema)
    said = "; every property shown is required, no other is allowed" if closed else ""
    return (f"Reply with one JSON object only (no prose, no code fence{said}) that matches "
            "this JSON schema:\n"
            + json.dumps(prompt_schema(schema, closed), ensure_ascii=False,
                         separators=(",", ":")))


def _all_closed(node: Any) -> bool:
    """Every object of the schema closed with all its properties required (``strict_schema``)."""
    if isinstance(node, list):
        return all(_all_closed(v) for v in node)
    if not isinstance(node, dict):
        return True
    props = node.get("properties")
    if isinstance(props, dict) and (node.get("additionalProperties") is not False
                                    or list(node.get("required") or []) != list(props)):
        return False
    if node.get("type") == "object" and not isinstance(props, dict):
        return False   # a map (``dict[str, X]``): its keys are open
    return all(_all_closed(v) for v in node.values())


def prompt_schema(schema: dict[str, Any], closed: bool = False) -> dict[str, Any]:
    """The schema as a reader needs it, without what only a validator uses: references
    inlined, pydantic's titles dropped, a run of consecutive integers as its bounds, and with
    ``closed`` (said once in the sentence before it) no ``required`` and
    ``additionalProperties`` lists. Under half the tokens of the full schema: they are paid on
    every call of the prompt form, after the cached head."""
    defs = schema.get("$defs") or {}
    first = ("type", "description", "enum")
    expanding: list[str] = []

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/") and ref[8:] in defs:
            if ref in expanding:
                raise RecursionError(ref)   # a recursive model: no finite inlined form
            expanding.append(ref)
            try:   # keys beside the reference (a field's description) stay with it
                return {**visit(defs[ref[8:]]),
                        **visit({k: v for k, v in node.items() if k != "$ref"})}
            finally:
                expanding.pop()
        out: dict[str, Any] = {}
        for k in sorted(node, key=lambda k: first.index(k) if k in first else len(first)):
            v = node[k]
            if k in ("title", "$defs") or (closed and k in ("required",
                                                            "additionalProperties")):
                continue
            out[k] = ({p: visit(s) for p, s in v.items()} if k == "properties"
                      and isinstance(v, dict) else visit(v))
        run = out.get("enum")
        if (out.get("type") == "integer" and isinstance(run, list) and len(run) > 2
                and all(type(x) is int for x in run)
                and run == list(range(run[0], run[0] + len(run)))):
            del out["enum"]
            out["minimum"], out["maximum"] = run[0], run[-1]
        return out

    try:
        return cast(dict[str, Any], visit(schema))
    except RecursionError:
        return schema


def with_instruction(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            m["content"] = f"{m['content']}\n\n{text}"
            return out
    return out + [{"role": "user", "content": text}]


@dataclass
class BatchState:
    """Where a submitted batch stands: ``ended`` once nothing more will be answered."""

    batch_id: str
    status: str
    ended: bool
    counts: dict[str, int] = field(default_factory=dict)


class Provider(abc.ABC):
    """What the client needs from an API: build a body, make one call, close. Subclasses are
    registered by ``provider/`` prefix in ``REGISTRY``; batch APIs are optional methods."""

    name = "provider"
    supports_n = False
    forms: tuple[str, ...] = ()
    default_form = "prompt"

    def __init__(self, model: str, *, base_url: str | None = None, concurrency: int = 16,
                 timeout: float = 120.0, structured_output: str | None = None,
                 system_role: bool = True, use_n: bool = True,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        """Every provider is made with these (``make_provider``) and uses those its API has."""
        self.model = model

    def _form(self, form: str | None) -> str:
        form = form or "auto"
        if form == "auto":
            return self.default_form
        if form not in self.forms:
            raise ModelSpecError(f"--structured-output {form}: {self.name}/ models take "
                                 f"{', '.join(('auto',) + self.forms)}")
        return form

    @abc.abstractmethod
    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        """One HTTP call for ``samples`` of ``req``."""

    async def close(self) -> None:
        return None

    def _label(self, what: str) -> str:
        return f"{self.name}/{self.model}: {what}"

    # -- batch APIs (optional): each method is one HTTP exchange, its errors mapped like a
    # single call's (``Retryable`` / ``RequestRejected``), so the caller retries them alike.

    offers_batch = False  # the protocol has a batch API (a given server may still lack it)

    def batch_request(self, req: LLMRequest, samples: list[int]) -> dict[str, Any]:
        """The body one batch line sends for ``samples`` of ``req``."""
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")

    async def submit_batch(self, lines: dict[str, dict[str, Any]]) -> str:
        """Submit ``custom_id -> body``; return the batch id."""
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")

    async def poll_batch(self, batch_id: str) -> BatchState:
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")

    async def batch_results(self, batch_id: str) -> dict[str, Reply]:
        """``custom_id -> reply`` for every line the batch answered (errored, expired or
        cancelled lines are absent)."""
        raise LLMError(f"{self.name}/ models have no batch API; drop --batch")
