"""Parsing OpenAI-style chat messages (shared by every chat-log format) into ``Message``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from draco_cli.errors import InputError
from draco_cli.ingest.episode import Episode, Message, ToolCall

Item = tuple[str, Episode | InputError]  # an entry's place in its file, and what it made


class EntryContext:
    """Where we are, so every error names file, entry and field."""

    def __init__(self, source: str, where: str) -> None:
        self.source = source
        self.where = where

    def error(self, message: str, field: str | None = None) -> InputError:
        return InputError(message, file=self.source, row=self.where, field=field)

    def require(self, obj: Any, key: str, types: type | tuple[type, ...], path: str = "") -> Any:
        name = f"{path}{key}"
        if not isinstance(obj, dict):
            raise self.error("expected a JSON object", path.rstrip(".") or None)
        if key not in obj or obj[key] is None:
            raise self.error("missing", name)
        value = obj[key]
        if not isinstance(value, types) or isinstance(value, bool) and bool not in _tuple(types):
            raise self.error(f"expected {_type_names(types)}, got {type(value).__name__}", name)
        return value

    def optional(self, obj: dict[str, Any], key: str, types: type | tuple[type, ...],
                 path: str = "") -> Any:
        if obj.get(key) is None:
            return None
        return self.require(obj, key, types, path)


def as_object(value: Any) -> dict[str, Any]:
    """A JSON value that should be an object, or {} when it is anything else."""
    return value if isinstance(value, dict) else {}


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", list: "a list",
             dict: "an object", bool: "true/false"}
    return " or ".join(names.get(t, t.__name__) for t in _tuple(types))


def content_text(content: Any, ctx: EntryContext, field: str) -> str:
    """OpenAI content: a string, null, or a list of parts (text parts are kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and "type" in part:
                texts.append(f"[{part['type']}]")  # an image or audio part: keep a marker
            else:
                raise ctx.error("content part is neither text nor a typed part", f"{field}[{k}]")
        return "".join(texts)
    raise ctx.error(f"content must be a string, a list or null, got {type(content).__name__}",
                    field)


def parse_tool_calls(raw: Any, ctx: EntryContext, field: str) -> list[ToolCall]:
    """OpenAI ``tool_calls`` ({id, function: {name, arguments}}) or the flat form used by tau2
    ({id, name, arguments})."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ctx.error("tool_calls must be a list", field)
    calls = []
    for k, call in enumerate(raw):
        path = f"{field}[{k}]."
        if not isinstance(call, dict):
            raise ctx.error("expected a JSON object", f"{field}[{k}]")
        function = call.get("function")
        fn: dict[str, Any] = function if isinstance(function, dict) else call
        fpath = path + "function." if fn is not call else path
        name = ctx.require(fn, "name", str, fpath)
        args = fn.get("arguments", {})
        calls.append(ToolCall(id=ctx.optional(call, "id", str, path), name=name, arguments=args))
    return calls


def parse_message(raw: Any, ctx: EntryContext, field: str) -> Message:
    if not isinstance(raw, dict):
        raise ctx.error("message is not a JSON object", field)
    role = raw.get("role")
    if not isinstance(role, str):
        raise ctx.error("missing or non-string role", f"{field}.role")
    msg = Message(role=role, content=content_text(raw.get("content"), ctx, f"{field}.content"))
    if role in ("assistant", "user"):  # tau2's user simulator has tools too (telecom)
        msg.calls = parse_tool_calls(raw.get("tool_calls"), ctx, f"{field}.tool_calls")
    elif role == "tool":
        call_id = raw.get("tool_call_id", raw.get("id"))
        msg.call_id = call_id if isinstance(call_id, str) else None
        msg.name = raw.get("name") if isinstance(raw.get("name"), str) else None
    n = raw.get("n_tokens")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ctx.error("n_tokens must be a non-negative integer", f"{field}.n_tokens")
        msg.n_tokens = n
    return msg


def parse_messages(raw: Any, ctx: EntryContext, field: str = "messages") -> list[Message]:
    if raw is None:
        raise ctx.error("missing", field)
    if not isinstance(raw, list):
        raise ctx.error("expected a list of messages", field)
    return [parse_message(m, ctx, f"{field}[{i}]") for i, m in enumerate(raw)]


def trainer_tokens(raw: dict[str, Any], ctx: EntryContext
                   ) -> tuple[list[int] | None, list[int] | None]:
    """The trainer's ``response_mask`` (0/1 per response token) and optional ``response_ids``
    of an entry: positions straight from the trainer, exact by construction."""
    mask = ctx.optional(raw, "response_mask", list)
    ids = ctx.optional(raw, "response_ids", list)
    if ids is not None and mask is None:
        raise ctx.error("response_ids needs response_mask beside it", "response_ids")
    if mask is None:
        return None, None
    if any(m not in (0, 1) or isinstance(m, bool) for m in mask):
        raise ctx.error("response_mask must hold only 0 and 1", "response_mask")
    if ids is not None:
        if len(ids) != len(mask):
            raise ctx.error(f"response_ids has {len(ids)} tokens, response_mask {len(mask)}",
                            "response_ids")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ctx.error("response_ids must hold non-negative integers", "response_ids")
    return mask, ids


def json_lines(fp: TextIO, source: str, to_episode: Callable[[Any, EntryContext, int], Episode]
               ) -> Iterator[Item]:
    """(where, the episode or the InputError it makes) of each non-blank line of a JSON Lines
    file; ``to_episode(value, context, line number)`` reads a line's JSON value."""
    for lineno, line in enumerate(fp, start=1):
        where = f"line {lineno}"
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            yield where, to_episode(raw, EntryContext(source, where), lineno)
        except json.JSONDecodeError as exc:
            # A line cut short fails at its very end (or inside an unterminated string).
            cut = exc.pos >= len(line.rstrip()) or exc.msg.startswith("Unterminated")
            what = "truncated JSON" if cut else "invalid JSON"
            yield where, InputError(f"{what} ({exc.msg} at column {exc.colno})",
                                    file=source, row=where)
        except RecursionError:
            yield where, InputError("JSON nested too deeply to be a rollout", file=source,
                                    row=where)
        except InputError as exc:
            yield where, exc


def first_user_text(messages: list[Message]) -> str:
    """The first user message's text (a log's instruction when it names none), or ""."""
    return next((m.content for m in messages if m.role == "user"), "")
