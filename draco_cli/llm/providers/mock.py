"""``mock/ANYTHING``: an in-process provider for a user's CI. Each request is answered with a
small instance of its own JSON schema: no server, no key, no cost. Each call's choices are
numbered from 0 (enums cycle with the number, strings carry it), as the test server's are."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from draco_cli.llm.providers.base import Provider
from draco_cli.llm.types import Choice, LLMRequest, Reply, Usage


def instance(schema: dict[str, Any], seed: int = 0, path: str = "",
             root: dict[str, Any] | None = None, salt: int = 0) -> object:
    """A small value valid against ``schema``: enums cycle with the position (shifted by
    ``salt``), arrays take their minimum length (at least one item), strings are distinct per
    position."""
    root = root if root is not None else schema
    if "$ref" in schema:  # pydantic puts nested models under #/$defs/Name
        node: Any = root  # JSON: a bad reference fails here as a KeyError
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return instance(node, seed, path, root, salt)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][(seed + salt) % len(schema["enum"])]
    kind = schema.get("type")
    if kind == "object":
        return {k: instance(v, seed, f"{path}.{k}", root, salt)
                for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        n = max(schema.get("minItems", 1), 1)
        n = min(n, schema.get("maxItems", n))
        return [instance(schema.get("items") or {}, k, f"{path}[{k}]", root, salt)
                for k in range(n)]
    if kind == "integer":
        return schema.get("minimum", 1)
    if kind == "number":
        return schema.get("minimum", 1.0)
    if kind == "boolean":
        return True
    return f"mock {path.strip('.') or 'text'} {seed}"


class MockProvider(Provider):
    name = "mock"
    supports_n = True
    forms = ("json-schema",)
    default_form = "json-schema"

    def __init__(self, model: str, *, structured_output: str | None = None, use_n: bool = True,
                 **_: Any) -> None:
        self.model = model
        self.form = self._form(structured_output)
        self.supports_n = use_n   # --no-use-n: one call per sample, as a server without n

    async def complete(self, req: LLMRequest, messages: list[dict[str, str]],
                       samples: list[int]) -> Reply:
        schema = req.schema()
        # Enum answers (verdicts) shift with the request's text, so rollouts of one group are
        # judged differently and a mock run gives the trainer a signal, as a real judge would.
        salt = int.from_bytes(hashlib.blake2b(json.dumps(messages, sort_keys=True).encode(),
                                              digest_size=4).digest(), "big")
        choices = [Choice(text=json.dumps(instance(schema, k, salt=salt)), finish="stop")
                   for k in range(len(samples))]
        body = {"model": self.model, "messages": messages, "n": len(samples),
                **{k: v for k in ("temperature", "seed")
                   if (v := getattr(req.sampling, k)) is not None}}
        return Reply(choices, Usage(), body, {"mock": True}, 0.0)
