"""The default redaction's literal prefilter against the plain pass it stands for: every
default pattern combined into one expression and run over every text. Same output, same count,
for any input (the prefilter may only skip texts the plain pass would leave unchanged)."""

from __future__ import annotations

import json
import re
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from draco_cli import redact as R
from draco_cli.redact import DEFAULT_PATTERNS, MASK, Redactor
from tests.conftest import SHARED_DATA, examples

PLAIN = re.compile("|".join(DEFAULT_PATTERNS))
TEMPLATE = "".join(rf"\g<{k}>" for keys, _ in R._DEFAULTS for k in keys) + MASK


def plain(text: str) -> tuple[str, int]:
    return PLAIN.subn(TEMPLATE, text) if text else (text, 0)


# Pieces of secrets and of their keys in many spellings, folded letters, separators, noise.
FRAGMENTS = [
    "password", "PassWord", "pa\u017f\u017fword", "passwd", "passphrase", "PWD", "pwd",
    "secret", "\u017fecret", "aws_secret_access_key", "SecretAccessKey", "bearer", "BEARER",
    "Bearer", "sk-", "SK-", "AKIA", "ASIA", "akia", "AIza", "xoxb-", "xox", "eyJ", "eyj",
    "ghp_", "gho_", "GHP_", "github_pat_", "\u212a", "\u0130", "\u0131", "\x00", "=", ": ",
    ":", '"', "'", " ", "\n", "\t", ".", "-", "_", "/", "+", "&", "A" * 16, "a1B2" * 5,
    "Zz09" * 4, "passenger", "Asia", "flight", "\u00e9", "\U0001f600", "\ud800",
    "-----BEGIN RSA PRIVATE KEY-----", "-----END RSA PRIVATE KEY-----", "://", "@", "user:pw",
    "Authorization", "Basic ", "dXNlcjpwYXNz", "sk_live_", "rk_test_", "hf_", "glpat-",
    "api_key", "ApiKey", "token", "TOKEN", "client_secret", "DB_PASS", "?pass", "&pass",
    "private_key", "AccountKey", "--password ", " is ", "credentials", "-u ", "--user=",
    "npm_", "xapp-", "GOCSPX-", "ya29.", "SG.", "whsec_", "=>", ":=", "\\", "`", "\u0130",
    "\u0131", "{", "}", ",", ";",
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)),
                 max_size=30).map("".join)


@settings(max_examples=examples(600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(texts, max_size=4))
@example(["pa\u017f\u017fword=hunter2"])              # the long s: (?i) reads it as "s"
@example(["\u017fecret_access_key=" + "A" * 40])
@example(["BEARER abcdefghijklmnop", "x", "Bearer abcdefghijklmnop"])
def test_texts_as_the_plain_pass(batch):
    r = Redactor()
    done = [plain(t) for t in batch]
    assert [r(t) for t in batch] == [d[0] for d in done]
    assert r.count == sum(d[1] for d in done)


def test_user_patterns_apply_after_the_defaults():
    r = Redactor([r"hunter\d"])
    assert [r(t) for t in ["x" * 3000, "my hunter2 and hunter3", None, ""]] == \
        ["x" * 3000, f"my {MASK} and {MASK}", None, ""]
    assert r.count == 2


# Characters other than ASCII letters that ``re`` matches as an ASCII letter when it ignores case.
FOLDED = ("\u017f", "\u212a", "\u0130", "\u0131")


def test_folded_characters_are_every_non_ascii_match_of_a_case_insensitive_letter():
    """Every character outside ASCII that ``re`` matches as an ASCII letter case-insensitively
    is in ``FOLDED`` (any letter: the prefilter could otherwise clear a secret), and the
    prefilter reads each as that letter."""
    pat = re.compile("(?i)[a-z]")
    found = {chr(cp) for cp in range(0x80, sys.maxunicode + 1) if pat.fullmatch(chr(cp))}
    assert found <= set(FOLDED), sorted(found - set(FOLDED))
    for c in FOLDED:
        letter = next(a for a in "abcdefghijklmnopqrstuvwxyz" if re.fullmatch(f"(?i){a}", c))
        assert letter in R._lowered(c)


DATA = SHARED_DATA


@pytest.mark.skipif(not (DATA / "tau-bench").exists(), reason="needs the shared data (DRACO_SHARED_DATA)")
def test_real_rollout_texts_as_the_plain_pass():
    out: list[str] = []
    for f in sorted((DATA / "tau-bench").glob("*.json"))[:2]:
        for entry in json.loads(f.read_text()):
            out += [m.get("content") or "" for m in entry["traj"] if isinstance(m, dict)]
    out = [t for t in out if isinstance(t, str)][:3000]
    r = Redactor()
    assert [r(t) for t in out] == [plain(t)[0] for t in out]
