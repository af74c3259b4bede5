"""What a reply's choice is worth: a valid answer, or why not, and the question to ask again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from draco_cli.llm.types import Choice, LLMRequest


def parse_choice(req: LLMRequest, choice: Choice) -> tuple[BaseModel | None, str, str | None]:
    """(the validated answer or None, status "ok" / "refused" / "truncated" / "invalid", the
    reason it is not an answer)."""
    if choice.finish == "refusal" or choice.refusal:
        return None, "refused", f"refused: {(choice.refusal or choice.text or '')[:200]}"
    if choice.finish == "length":
        return None, "truncated", "truncated at max_tokens " \
            f"({req.sampling.max_tokens}): raise --max-tokens"
    if not choice.text:
        return None, "invalid", "empty answer"
    try:
        value = req.answer_model.model_validate_json(choice.text)
    except ValidationError as exc:
        first: Mapping[str, Any] = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        kind = "not JSON" if first.get("type") == "json_invalid" else "schema violation"
        return None, "invalid", f"{kind}: {where + ': ' if where else ''}{first.get('msg', exc)}"
    problem = req.problem(value)
    if problem is not None:
        return None, "invalid", problem
    return value, "ok", None


def reask(req: LLMRequest, choice: Choice, status: str,
          error: str | None) -> list[dict[str, str]]:
    """The messages that ask again after an answer that is not one: the same question after a
    truncation (sampling may end sooner), else with the validation error fed back."""
    if status == "truncated":
        return req.messages
    return req.messages + [
        {"role": "assistant", "content": choice.text or ""},
        {"role": "user", "content": (
            "That answer is not valid JSON for the required schema: "
            f"{error}. Reply again with only a JSON object that matches the schema.")},
    ]
