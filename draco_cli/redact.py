"""Masking secrets in rollout text before any of it leaves the machine (``--redact``) or is
shown (``draco report``).

The default patterns are combined into one regular expression, so a text is scanned once
whatever the number of patterns, and only when a prefilter of literal substrings says it may
hold a secret (then by the combination of just the patterns it may match). The judge stage
redacts every action and observation of every rollout, on its hot path: it hands a rollout's
texts over as one batch (``Redactor.many``), screened at once for pieces of those literals
(see benchmarks/bench_redact.py). Where a secret follows a key (``password = "x"``), the key
is kept and only the value masked: each such pattern captures its key in a named group, and
the replacement template puts back whichever of those groups matched (unmatched groups are
empty).
"""

from __future__ import annotations

import functools
import re
from typing import Any

MASK = "[REDACTED]"

_PASSWORD_KEY = r"(?i:password|passwd|passphrase|pwd)"
_AWS_SECRET_KEY = r"(?i:(?:aws_?)?secret_?access_?key)"

# (name of the group holding the kept key, or None; pattern). Order matters only between
# alternatives that can start at the same character: the longer, more specific one first.
_DEFAULTS: tuple[tuple[str | None, str], ...] = (
    (None, r"github_pat_[A-Za-z0-9_]{22,}"),                  # GitHub fine-grained tokens
    (None, r"gh[pousr]_[A-Za-z0-9]{30,}"),                    # GitHub classic tokens
    (None, r"sk-[A-Za-z0-9_\-]{16,}"),                        # OpenAI / Anthropic style keys
    (None, r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),                 # AWS access key ids
    (None, r"\bAIza[0-9A-Za-z_\-]{35}"),                      # Google API keys
    (None, r"xox[baprs]-[A-Za-z0-9\-]{10,}"),                 # Slack tokens
    (None, r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),  # JWTs
    # AWS secret access keys: 40 base64 characters after their key name
    ("k_aws", _AWS_SECRET_KEY + r"""["']?\s*[:=]\s*["']?(?=[A-Za-z0-9/+]{40})"""),
    ("k_bearer", r"(?i:\bbearer)\s+(?=[A-Za-z0-9._\-~+/]{12,})"),  # Authorization: Bearer ...
    # password = "x", 'password': 'x', "password":"x", password: "x" — quoted value
    ("k_pwq", _PASSWORD_KEY + r"""["']?\s*[:=]\s*["'](?=[^"'\n])"""),
    # password=x (URLs, code, env files), password: x (prose) — bare value
    ("k_pw", _PASSWORD_KEY + r"""["']?\s*[:=]\s*(?=[^\s&'",;}\]])"""),
)
# What each keyed pattern masks after its key.
_VALUES = {
    "k_aws": r"[A-Za-z0-9/+=]{40,}",
    "k_bearer": r"[A-Za-z0-9._\-~+/]{12,}=*",
    "k_pwq": r"""[^"'\n]+""",
    "k_pw": r"""[^\s&'",;}\]]+""",
}

# Kept for callers that list the patterns; each is a full pattern on its own.
DEFAULT_PATTERNS: tuple[str, ...] = tuple(
    p if key is None else f"(?P<{key}>{p}){_VALUES[key]}" for key, p in _DEFAULTS)

# Every default pattern contains one of its (lower-cased) literals. Most texts contain none,
# and a few substring searches in C cost far less than one regex scan of the text; a text that
# does contain some is scanned once by the combination of just the patterns it may match.
_TRIGGERS: tuple[tuple[str, ...], ...] = (
    ("github_pat_",), ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"), ("sk-",), ("akia", "asia"),
    ("aiza",), ("xox",), ("eyj",), ("secret",), ("bearer",),
    ("password", "passwd", "passphrase", "pwd"), ("password", "passwd", "passphrase", "pwd"),
)
assert len(_TRIGGERS) == len(_DEFAULTS)


@functools.lru_cache(maxsize=256)
def _combination(active: tuple[int, ...]) -> tuple[re.Pattern[str], str]:
    keys = [_DEFAULTS[i][0] for i in active if _DEFAULTS[i][0]]
    return (re.compile("|".join(DEFAULT_PATTERNS[i] for i in active)),
            "".join(rf"\g<{k}>" for k in keys) + MASK)


# Every trigger literal once, with the patterns it may start: one flat loop of substring tests
# (a generator per pattern cost more than the tests themselves).
_LITERALS: tuple[str, ...] = tuple(dict.fromkeys(t for trig in _TRIGGERS for t in trig))
_PATTERNS_OF = {lit: tuple(i for i, trig in enumerate(_TRIGGERS) if lit in trig)
                for lit in _LITERALS}


# Characters other than ASCII letters that a case-insensitive pattern matches as one of its
# letters: the long s matches "s" (``(?i:password)`` matches "paſſword"), the Kelvin sign "k".
# ``str.lower`` maps the Kelvin sign to "k" but keeps the long s, so the prefilter maps it.
# (tests/test_redact_fast.py checks every code point against ``re``.)
FOLDED = ("\u017f", "\u212a")


def _lowered(text: str) -> str:
    low = text.lower()
    return low.replace("\u017f", "s") if "\u017f" in low else low


def _redact_defaults(text: str) -> tuple[str, int]:
    low = _lowered(text)
    found = [lit for lit in _LITERALS if lit in low]
    if not found:
        return text, 0
    active = tuple(sorted({i for lit in found for i in _PATTERNS_OF[lit]}))
    pattern, template = _combination(active)
    return pattern.subn(template, text)


# The screen for many texts at once (``Redactor.many``): one three-letter piece of each trigger
# literal. A text holding a literal holds its piece, so a batch whose bytes hold none of the
# pieces holds no literal and no secret. Pieces are compared on UTF-8 bytes with bit 0x20 set
# (ASCII letters of either case become lower case; other bytes may collide, which only sends
# a batch down the exact path); bytes of non-ASCII characters all have bit 7 set and never
# look like the ASCII pieces. The pieces are picked to be rare in ordinary text ("pas" would
# flag every "passenger").
_PIECE = {
    "github_pat_": "b_p", "ghp_": "hp_", "gho_": "ho_", "ghu_": "hu_", "ghs_": "hs_",
    "ghr_": "hr_", "sk-": "sk-", "akia": "kia", "asia": "sia", "aiza": "aiz", "xox": "xox",
    "eyj": "eyj", "secret": "ecr", "bearer": "rer", "password": "ssw", "passwd": "ssw",
    "passphrase": "sph", "pwd": "pwd",
}
assert set(_PIECE) == set(_LITERALS) and all(p in lit for lit, p in _PIECE.items())
# Below this many characters a batch is screened text by text (numpy's fixed costs dominate).
MANY_MIN_CHARS = 2048
_piece_table: list[object] = []


def _pieces() -> object:
    """A 2**24 table of booleans, True at the little-endian code of each piece (made once;
    ``np.zeros`` maps only the pages that lookups touch)."""
    if not _piece_table:
        import numpy as np

        table = np.zeros(1 << 24, dtype=np.bool_)
        for piece in set(_PIECE.values()):
            b = [c | 0x20 for c in piece.encode()]
            table[b[0] | b[1] << 8 | b[2] << 16] = True
        _piece_table.append(table)
    return _piece_table[0]


def may_hold_secret(texts: list[str]) -> bool:
    """False only if no default pattern can match in any of ``texts`` (then redacting them
    changes nothing): no trigger literal's piece occurs in their bytes and no character that
    folds to an ASCII letter (``FOLDED``) occurs either. One pass of a few array operations
    over all of them instead of a substring search per literal per text."""
    import numpy as np

    joined = "\x00".join(texts)
    if any(c in joined for c in FOLDED):
        return True
    raw = (joined + "\x00\x00\x00").encode("utf-8", "surrogatepass")
    folded = np.frombuffer(raw, dtype=np.uint8) | 0x20
    # every window of 4 bytes as a little-endian uint32 (an overlapping view, no copy); its
    # low 3 bytes are the 3-byte piece starting there
    windows = np.ndarray(shape=(len(raw) - 3,), dtype="<u4", buffer=folded, strides=(1,))
    table: Any = _pieces()
    # (``take`` gathers in C at about half the time of fancy indexing)
    return bool(np.take(table, windows & 0xFFFFFF).any())


class Redactor:
    def __init__(self, extra: list[str] | tuple[str, ...] = (), defaults: bool = True) -> None:
        # User patterns stay separate: combining them would renumber their groups (and break
        # any backreference they hold).
        try:
            self._extra = [re.compile(p) for p in extra]
        except re.error as exc:
            from draco_cli.errors import UsageError

            raise UsageError(f"--redact: not a regular expression ({exc})") from None
        self._defaults = defaults
        self.count = 0

    def __call__(self, text: str) -> str:
        if not text:
            return text
        if self._defaults:
            text, n = _redact_defaults(text)
            self.count += n
        for r in self._extra:
            text, n = r.subn(MASK, text)
            self.count += n
        return text

    def many(self, texts: list[str]) -> list[str]:
        """``[self(t) for t in texts]``, with the default patterns screened for the whole
        batch at once (``may_hold_secret``): a batch that cannot hold a secret is not searched
        text by text (the judge stage redacts ~17 texts per request)."""
        present = [t for t in texts if t]
        if not self._defaults or sum(map(len, present)) < MANY_MIN_CHARS:
            return [self(t) for t in texts]
        if may_hold_secret(present):
            return [self(t) for t in texts]
        out = list(texts)
        for r in self._extra:
            for i, t in enumerate(out):
                if t:
                    out[i], n = r.subn(MASK, t)
                    self.count += n
        return out


def redact(text: str) -> str:
    """The default redaction, for text shown rather than sent (``draco report``)."""
    return _redact_defaults(text)[0] if text else text
