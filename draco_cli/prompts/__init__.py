"""Versioned prompt templates. A template's file name carries its version (``score.v1.txt``);
the version enters every request's cache key, so editing a prompt means a new file, and cached
answers to the old prompt are never served for the new one."""

from __future__ import annotations

import functools
from importlib import resources

CURRENT = {"generate": "v1", "union": "v1", "merge": "v1", "score": "v2"}


@functools.cache
def load_prompt(name: str) -> tuple[str, str]:
    """(template text, version label such as 'score.v1')."""
    version = CURRENT[name]
    text = resources.files("draco_cli.prompts").joinpath(f"{name}.{version}.txt").read_text()
    return text, f"{name}.{version}"
