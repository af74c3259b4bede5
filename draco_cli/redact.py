"""Masking secrets in rollout text before any of it leaves the machine (``--redact``)."""

from __future__ import annotations

import re

MASK = "[REDACTED]"

# Default patterns: API keys of common providers, bearer tokens, and password-like assignments.
DEFAULT_PATTERNS = (
    r"sk-[A-Za-z0-9_\-]{16,}",                       # OpenAI / Anthropic style keys
    r"(?:AKIA|ASIA)[A-Z0-9]{16}",                    # AWS access key ids
    r"gh[pousr]_[A-Za-z0-9]{30,}",                   # GitHub tokens
    r"xox[baprs]-[A-Za-z0-9\-]{10,}",                # Slack tokens
    r"(?i)(?<=bearer )[A-Za-z0-9._\-~+/]{12,}=*",    # Authorization: Bearer <token>
    r"(?i)(?<=\"password\": \")[^\"]+",              # JSON "password": "..."
    r"(?i)(?<=password=)[^\s&'\",;]+",                # password=... in URLs, code
    r"(?i)(?<=password: )[^\s'\",;]+",                # password: ... in prose
    r"(?i)(?<=passwd=)[^\s&'\",;]+",
)


class Redactor:
    def __init__(self, extra: list[str] | tuple[str, ...] = (), defaults: bool = True) -> None:
        patterns = list(DEFAULT_PATTERNS if defaults else ()) + list(extra)
        try:
            self._res = [re.compile(p) for p in patterns]
        except re.error as exc:
            from draco_cli.errors import UsageError

            raise UsageError(f"--redact: not a regular expression ({exc})") from None
        self.count = 0

    def __call__(self, text: str) -> str:
        for r in self._res:
            text, n = r.subn(MASK, text)
            self.count += n
        return text
