"""Adapters that hand draco's token advantages to a trainer, keyed on per-row ids.

Each submodule imports its trainer (and torch) only when used, so ``import draco_cli`` and
``import draco_cli.trainers`` never import torch. Install the trainers with the
``trainers`` extra (see docs/trainers.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def field_of(obj: Any, name: str, default: Any = None) -> Any:
    """``obj[name]`` of a mapping (a record in its saved dict form), else ``obj.name`` (the
    trainer's own object): the adapters read both."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def lazy_class(namespace: dict[str, Any], name: str,
               builders: Mapping[str, Callable[[], type[Any]]]) -> type[Any]:
    """A module ``__getattr__``: class ``name`` built by its builder on first use and kept in
    the module's ``namespace`` (its globals); any other name an AttributeError."""
    if name not in builders:
        raise AttributeError(name)
    cls = namespace[name] = builders[name]()
    return cls
