"""Masking secrets in rollout text before any of it leaves the machine (``--redact``) or is
shown (``draco report``).

The default patterns are combined into one regular expression, so a text is scanned once
whatever the number of patterns, and only when a prefilter of literal substrings says it may
hold a secret (then by the combination of just the patterns it may match, tried only where
one of their literals occurs: every match starts with one). Where a secret follows a key
(``password = "x"``), the key is kept and only the value masked: each such pattern captures
its key in a named group, and the replacement template puts back whichever of those groups
matched (unmatched groups are empty).
"""

from __future__ import annotations

import functools
import re

MASK = "[REDACTED]"


def _after(word: str, prefixes: str) -> str:
    """``word`` (any case) where one of ``prefixes`` (space-separated, any case) comes right
    before it, joined or by ``_``/``-``: the match starts at ``word``, the prefix is looked
    behind (grouped by length, as a look-behind has one width)."""
    by_len: dict[int, list[str]] = {}
    for prefix in prefixes.split():
        by_len.setdefault(len(prefix), []).append(prefix)
    behind = [f"(?<=(?i:{'|'.join(ps)}){sep}(?i:{word}))" for _, ps in sorted(by_len.items())
              for sep in ("", r"[_\-]")]
    return f"(?i:{word})(?:{'|'.join(behind)})"


# Names of a field, variable or header whose value is a secret whatever it looks like; the name
# may end a longer one (``DB_PASSWORD``, ``x-api-key``, ``AWS_SECRET_ACCESS_KEY``,
# ``clientSecret``, ``_authToken``). Every match starts at one of the literals the prefilter
# looks for (the name's last word; for ``key`` and ``token``, the word before is looked behind).
_SECRET_NAME = (
    r"(?:(?i:pass(?:word|wd|phrase)|pwd|_pass(?==)|[?&;]pass|secret(?:[_\-]?key)?)|"
    + _after("key", "api private access account signing encryption master") + "|"
    + _after("token", "access refresh auth api bearer session oauth id csrf xsrf github gh "
             "gitlab hf npm slack bot discord telegram") + ")")
# Names whose values are secrets only when they look like one (``"token": "Hello"`` is a
# token of text; ``key=lambda x: x`` is not a key).
_WEAK_NAME = r"(?i:token|key)"
# After a name: its closing quote (JSON, possibly escaped inside another string), then
# ``:``, ``=``, ``=>`` or ``:=``.
_NAME_END = r"""(?:\\?["'])?[ \t]*"""
_TOKEN_LIKE = (r"(?=[A-Za-z0-9+/=_.~\-]*[0-9])(?=[A-Za-z0-9+/=_.~\-]*[A-Za-z])"
               r"[A-Za-z0-9+/=_.~\-]{16,}")
# A PEM private key, from BEGIN to END (or to the end of a cut text), over lines or ``\n``s.
_PEM = (r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"(?:-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----|\Z)")

# (names of the groups kept in front of the mask, pattern). Order matters only between
# alternatives that can start at the same character: the longer, more specific one first.
_DEFAULTS: tuple[tuple[tuple[str, ...], str], ...] = (
    ((), r"github_pat_[A-Za-z0-9_]{22,}"),                    # GitHub fine-grained tokens
    ((), r"gh[pousr]_[A-Za-z0-9]{30,}"),                      # GitHub classic tokens
    ((), r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_\-]{16,}"),          # OpenAI / Anthropic keys
    ((), r"(?<![A-Za-z0-9])[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"),  # Stripe secret keys
    ((), r"whsec_[A-Za-z0-9]{20,}"),                          # Stripe webhook secrets
    ((), r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}"),             # Hugging Face tokens
    ((), r"gl(?:pat|ptt|dt|rt|cbt|ft|imt)-[A-Za-z0-9_\-]{20,}"),  # GitLab tokens
    ((), r"(?<![A-Za-z0-9])npm_[A-Za-z0-9]{36}"),             # npm tokens
    ((), r"pypi-AgEIcHlwaS5vcmc[A-Za-z0-9_\-]{40,}"),         # PyPI tokens
    ((), r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}"),              # Shopify tokens
    ((), r"do[opr]_v1_[a-f0-9]{64}"),                         # DigitalOcean tokens
    ((), r"(?<![A-Za-z0-9])SG\.[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}"),  # SendGrid keys
    ((), r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),                   # AWS access key ids
    ((), r"\bAIza[0-9A-Za-z_\-]{35}"),                        # Google API keys
    ((), r"GOCSPX-[A-Za-z0-9_\-]{20,}"),                      # Google OAuth client secrets
    ((), r"\bya29\.[0-9A-Za-z_\-]{20,}"),                     # Google OAuth access tokens
    ((), r"xox[abeoprs]-[A-Za-z0-9\-]{10,}"),                 # Slack tokens
    ((), r"xapp-[0-9]-[A-Za-z0-9\-]{10,}"),                   # Slack app tokens
    ((), r"hooks\.slack\.com/services/[A-Za-z0-9/_\-]{20,}"),  # Slack webhooks
    ((), r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),  # JWTs
    ((), _PEM),                                               # PEM private keys
    # Authorization / Proxy-Authorization headers, whatever the scheme
    (("k_auth",), r"""(?P<k_auth>(?i:authorization)""" + _NAME_END + r"""[:=][ \t]*(?:\\?["'])?"""
     r"(?:(?i:basic|bearer|token|digest|negotiate|ntlm|apikey|key)[ \t]+)?)"
     r"""[^\s"'\\,;]+"""),
    (("k_bearer",), r"(?P<k_bearer>(?i:\bbearer)\s+)[A-Za-z0-9._\-~+/]{12,}=*"),
    # user:password@ (or a long token@) in a URL or connection string
    (("k_url",), r"""(?P<k_url>://)(?:[^\s/?#@:'"<>\\]{0,256}:[^\s/?#'"<>\\]{1,256}"""
     r"|[A-Za-z0-9_.~%\-]{20,256})(?=@)"),
    # curl -u user:password, --user user:password
    (("k_curl",), r"""(?P<k_curl>(?<![\w\-])(?:-u +|--user[ =]+)["']?)[^\s"':@]+:[^\s"']+"""),
    # a secret-named field: "password": "x", password: x y, PASSWORD=x, api_key => 'x'; a
    # quoted value up to its closing quote, a bare one after "=" to the next space or
    # separator, after ":" to the end of the line (YAML); a PEM key whole, either way
    (("k_f", "k_fq"), r"(?P<k_f>" + _SECRET_NAME + _NAME_END
     + r"(?:=>|:=|=|(?P<k_fc>:))[ \t]*)(?:" + _PEM + r"|(?P<k_fq>\\?[\"'])(?:" + _PEM
     + r"""|[^"'\\\n]|\\[^"'\n]|(?!(?P=k_fq))["'])+"""
     r"""|(?(k_fc)[^\s"',;}\]\\<>][^\n"',;}\]\\<>]*|[^\s&'",;}\]]+))"""),
    # a command-line flag: --password x, --db-password x, --api-key x (after = above)
    (("k_flag",), r"""(?P<k_flag>(?<=-)(?:(?i:pass(?:word|wd|phrase)|secret|token)|"""
     + _after("key", "api access secret private") + r""")[ \t]+["']?)[^\s"'\-][^\s"']*"""),
    # prose: "the password is hunter2" (a value holding a digit or a sign, not a word)
    (("k_is",), r"(?P<k_is>(?i:pass(?:word|phrase|code))[ \t]+(?i:is|was)[ \t]+[\"'`]?)"
     r"""(?=[^\s"'`]*[^\sA-Za-z"'`.,;:!?)])[^\s"'`]*[^\s"'`.,;:!?)]"""),
    # a weakly named field holding a token-like value
    (("k_w",), r"(?P<k_w>" + _WEAK_NAME + _NAME_END
     + r"""(?:=>|:=|[:=])[ \t]*(?:\\?["'])?(?:(?i:basic|bearer|token)[ \t]+)?)"""
     + _TOKEN_LIKE),
)

# Kept for callers that list the patterns; each is a full pattern on its own.
DEFAULT_PATTERNS: tuple[str, ...] = tuple(p for _, p in _DEFAULTS)

# Every default pattern contains one of its (lower-cased) literals. Most texts contain none,
# and a few substring searches in C cost far less than one regex scan of the text; a text that
# does contain some is scanned once by the combination of just the patterns it may match.
# Each pattern's literals are those its matches start with (lower-cased): a match can only
# start where one of them occurs in the lower-cased text.
_SECRET_LITERALS = ("password", "passwd", "passphrase", "pwd", "_pass=", "?pass", "&pass",
                    ";pass", "secret", "key", "token")
_TRIGGERS: tuple[tuple[str, ...], ...] = (
    ("github_pat_",), ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"), ("sk-",),
    ("sk_live_", "rk_live_", "sk_test_", "rk_test_"), ("whsec_",), ("hf_",),
    ("glpat-", "glptt-", "gldt-", "glrt-", "glcbt-", "glft-", "glimt-"), ("npm_",),
    ("pypi-ageichlwas5vcmc",), ("shp",), ("doo_v1_", "dop_v1_", "dor_v1_"), ("sg.",),
    ("akia", "asia"), ("aiza",), ("gocspx-",), ("ya29.",), ("xox",), ("xapp-",),
    ("hooks.slack.com/services/",), ("eyj",), ("-----begin",), ("authorization",),
    ("bearer",), ("://",), ("-u ", "--user"), _SECRET_LITERALS,
    ("password", "passwd", "passphrase", "secret", "token", "key"),
    ("password", "passphrase", "passcode"), ("token", "key"),
)
assert len(_TRIGGERS) == len(_DEFAULTS)


@functools.lru_cache(maxsize=256)
def _combination(active: tuple[int, ...]) -> tuple[re.Pattern[str], str]:
    keys = [k for i in active for k in _DEFAULTS[i][0]]
    return (re.compile("|".join(DEFAULT_PATTERNS[i] for i in active)),
            "".join(rf"\g<{k}>" for k in keys) + MASK)


# Every trigger literal once, with the patterns it may start: one flat loop of substring tests
# (a generator per pattern cost more than the tests themselves).
_LITERALS: tuple[str, ...] = tuple(dict.fromkeys(t for trig in _TRIGGERS for t in trig))
_PATTERNS_OF = {lit: tuple(i for i, trig in enumerate(_TRIGGERS) if lit in trig)
                for lit in _LITERALS}


# Characters other than ASCII letters that a case-insensitive pattern matches as one of its
# letters: the long s matches "s" (``(?i:password)`` matches "pa\u017f\u017fword"), the Kelvin
# sign "k", the dotted capital I and the dotless i "i". ``str.lower`` maps the Kelvin sign to
# "k" but keeps the long s and the dotless i, and makes the dotted I two characters, so the
# prefilter maps them first. (tests/test_redact_prefilter.py checks every code point against
# ``re``.)
_FOLD = str.maketrans({"\u017f": "s", "\u0130": "i", "\u0131": "i"})


def _lowered(text: str) -> str:
    low = text.lower()
    if "\u017f" in low or "\u0131" in low or "\u0307" in low:
        return text.translate(_FOLD).lower()
    return low


def _redact_defaults(text: str) -> tuple[str, int]:
    low = _lowered(text)
    found = [lit for lit in _LITERALS if lit in low]
    if not found:
        return text, 0
    active = tuple(sorted({i for lit in found for i in _PATTERNS_OF[lit]}))
    pattern, template = _combination(active)
    if len(low) != len(text):   # lower-casing moved the positions (never, but stay exact)
        return pattern.subn(template, text)
    # A match can only start where a literal occurs: try the combination there alone (sre
    # would try each of its alternatives at every character, ~5 MB/s for thirty of them).
    starts: set[int] = set()
    for lit in found:
        at = low.find(lit)
        while at >= 0:
            starts.add(at)
            at = low.find(lit, at + 1)
    parts: list[str] = []
    last = n = 0
    match = pattern.match
    for at in sorted(starts):
        if at < last:
            continue
        m = match(text, at)
        if m is not None:
            parts += (text[last:at], m.expand(template))
            last = m.end()
            n += 1
    if not n:
        return text, 0
    parts.append(text[last:])
    return "".join(parts), n


class Redactor:
    def __init__(self, extra: list[str] | tuple[str, ...] = (), defaults: bool = True) -> None:
        # User patterns stay separate: combining them would renumber their groups (and break
        # any backreference they hold).
        self._extra = [re.compile(p) for p in extra]
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


def redact(text: str) -> str:
    """The default redaction, for text shown rather than sent (``draco report``)."""
    return _redact_defaults(text)[0] if text else text
