"""Keeping API keys out of everything draco writes (docs/llm.md, "Models"): text that might
echo one back passes through ``scrub`` before it is logged or shown."""

from __future__ import annotations

import os
import re

KEY_VARIABLES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "DRACO_API_KEY")
_PATTERNS = [
    re.compile(r"sk-[A-Za-z0-9_\-]{8,}"),              # OpenAI / Anthropic style keys
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._\-]{8,}"),  # Authorization: Bearer ...
    re.compile(r"(?i)(x-api-key['\"]?\s*[:=]\s*['\"]?)[A-Za-z0-9._\-]{8,}"),
]


def scrub(text: str | None) -> str | None:
    if not text:
        return text
    for var in KEY_VARIABLES:
        value = os.environ.get(var)
        if value and len(value) >= 6:
            text = text.replace(value, "[redacted]")
    # the default redaction of rollout text too (an error may quote a rollout's secret)
    from draco_cli.redact import redact

    text = redact(text)
    # Each pattern holds one of these literals; most texts (whole request bodies) hold none,
    # and three substring searches cost far less than three regex scans.
    low = text.lower()
    if "sk-" not in low and "bearer" not in low and "x-api-key" not in low:
        return text
    for pat in _PATTERNS:
        text = pat.sub(lambda m: (m.group(1) if m.groups() else "") + "[redacted]", text)
    return text
