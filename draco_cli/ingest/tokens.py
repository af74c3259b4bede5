"""Token counters used when a log does not carry the counts itself: a Hugging Face
``tokenizer.json`` or the explicit ``approx``, never a silent default. See docs/ingest.md,
"Token counts and positions".
"""

from __future__ import annotations

from collections.abc import Callable
import math
from pathlib import Path
from typing import Any

from draco_cli.errors import InputError

APPROX = "approx"
APPROX_CHARS_PER_TOKEN = 4
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


class ApproxCounter:
    """ceil(characters / 4): the usual rule of thumb for English text with BPE tokenizers.

    It is an approximation: code, JSON and non-English text tokenize denser. Manifests record
    that it was used.
    """

    name = APPROX
    exact = False

    def count(self, text: str) -> int:
        return math.ceil(len(text) / APPROX_CHARS_PER_TOKEN)

    def end_of_turn(self) -> int:
        return 0

    def observation_block(self, messages: list[tuple[str, str]]) -> int:
        return sum(self.count(text) for _, text in messages)


class HFTokenizerCounter:
    """Counts with a Hugging Face ``tokenizer.json``: a ChatML one by the n_tokens convention,
    others text only (docs/ingest.md, "Token counts and positions")."""

    exact = True

    def __init__(self, path: str) -> None:
        self._tok, self.name = _load_tokenizer(path, "no such tokenizer file (--tokenizer takes "
                                               "a tokenizer.json, its folder, or approx)")
        self._cache: dict[str, int] = {}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.chat_template = "chatml" if all(t in vocab for t in CHATML_TOKENS) else None

    def end_of_turn(self) -> int:
        return self.count(CHATML_TOKENS[1]) if self.chat_template else 0

    def observation_block(self, messages: list[tuple[str, str]]) -> int:
        if not self.chat_template:
            return sum(self.count(text) for _, text in messages)
        start, end = CHATML_TOKENS
        rendered = "\n" + "".join(f"{start}{role}\n{text}{end}\n" for role, text in messages)
        return self.count(rendered + f"{start}assistant\n")

    def count(self, text: str) -> int:
        if not text:
            return 0
        hit = self._cache.get(text)
        if hit is None:
            hit = len(self._tok.encode(text, add_special_tokens=False).ids)
            if len(self._cache) < 100_000:
                self._cache[text] = hit
        return hit


TokenCounter = ApproxCounter | HFTokenizerCounter


def make_counter(spec: str | None) -> TokenCounter | None:
    if spec is None:
        return None
    if spec == APPROX:
        return ApproxCounter()
    return HFTokenizerCounter(spec)


def apportion(total: int, weights: list[int], minimum: list[int]) -> list[int]:
    """Split ``total`` integer tokens over parts in proportion to ``weights`` (largest
    remainder), giving each part at least its ``minimum``. Used to split a message whose token
    count the log gives as a whole over its parts, whose relative sizes a tokenizer measured.
    """
    n = len(weights)
    floor = sum(minimum)
    if total < floor:
        raise ValueError("total below the sum of minimums")
    spare = total - floor
    wsum = sum(weights)
    if wsum == 0:
        weights, wsum = [1] * n, n
    exact = [spare * w / wsum for w in weights]
    base = [math.floor(x) for x in exact]
    left = spare - sum(base)
    order = sorted(range(n), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return [b + m for b, m in zip(base, minimum)]


def tokenizer_file_decode(path: str, *, skip_special_tokens: bool
                          ) -> tuple[Callable[[list[int]], str], str]:
    """``decode(ids) -> str`` of a Hugging Face tokenizer.json (the file, or the folder holding
    it), and the file's path; for record formats that hold token ids, not text."""
    tok, name = _load_tokenizer(path, "no such tokenizer file (expected a tokenizer.json)")
    return (lambda ids: str(tok.decode(ids, skip_special_tokens=skip_special_tokens))), name


def _load_tokenizer(path: str, missing: str) -> tuple[Any, str]:
    """A Hugging Face tokenizer.json (the file, or the folder holding it) and its path."""
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.exists():
        raise InputError(missing, file=str(p))
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(p)), str(p)
    except Exception as exc:  # the Rust side raises a bare Exception
        raise InputError(f"not a Hugging Face tokenizer.json ({exc})", file=str(p)) from None
