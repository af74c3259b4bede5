"""Versioned prompt templates. A template's file name carries its version (``score.v3.txt``);
the version enters every request's cache key, so editing a prompt means a new file, and cached
answers to the old prompt are never served for the new one.

Layout (``rules`` and the stage templates): every request's system message is the one ``rules``
text; its user message opens with the data the request is about (the task context, the task and
the fenced rollout, or the group's attempts) and only then the stage's own template, criteria
and candidates — so every call about a rollout (its rubric call, its k judge samples, re-asks)
starts with the same bytes, which the providers' prompt caches serve (``LLMRequest.cache_marks``).
"""

from __future__ import annotations

import functools
from importlib import resources

CURRENT = {"rules": "v2", "generate": "v3", "union": "v4", "merge": "v3", "score": "v4"}


@functools.cache
def load_template(name: str) -> str:
    version = CURRENT[name]
    return resources.files("draco_cli.prompts").joinpath(f"{name}.{version}.txt").read_text()


@functools.cache
def load_prompt(name: str) -> tuple[str, str]:
    """(stage template text, version label such as 'rules.v1+score.v3': the shared system
    rules' version and the stage's, both in every request's cache key)."""
    return load_template(name), f"rules.{CURRENT['rules']}+{name}.{CURRENT[name]}"


def system_rules() -> str:
    """The system message every rubric and judge request sends (the same bytes for all)."""
    return load_template("rules")
