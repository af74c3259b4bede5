"""The code blocks an agent's harness executed, for the ``code-block`` step unit. Fences,
heredocs and quotes, and which blocks ran: see docs/ingest.md, "Step units".
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import cast

from draco_cli.choices import CODE_BLOCKS, CodeBlocks
from draco_cli.errors import UsageError

DEFAULT_LANGUAGE = "bash"  # mini-swe-agent's

_OPEN = re.compile(r"[ \t]*(`{3,})([^`\n]*)")
_CLOSE = re.compile(r"[ \t]*(`{3,})[ \t]*")
SHELLS = frozenset({"bash", "sh", "shell", "zsh", "console", "mswea_bash_command"})
_HEREDOC = re.compile(r"<<-?[ \t]*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


@dataclass(frozen=True)
class Block:
    start: int  # offset of the opening fence's line
    end: int    # offset just past the closing fence (its newline excluded)
    language: str  # first word of the info string, lower-cased; "" when none


@dataclass(frozen=True)
class CodeRule:
    """Which fenced blocks ran: languages (None = any block) and how many a message may run."""

    languages: frozenset[str] | None = frozenset({DEFAULT_LANGUAGE})
    blocks: CodeBlocks = "one"

    @classmethod
    def parse(cls, language: str, blocks: str) -> CodeRule:
        """From the option texts: a comma-separated list of languages, or 'any'."""
        words = {w.strip().lower() for w in language.split(",") if w.strip()}
        if not words:
            raise UsageError("--code-language: give a language (e.g. bash, python) or 'any'")
        if blocks not in CODE_BLOCKS:
            raise UsageError(f"--code-blocks {blocks!r}: choose one of {', '.join(CODE_BLOCKS)}")
        return cls(None if "any" in words else frozenset(words), cast(CodeBlocks, blocks))

    def describe(self) -> str:
        return "any" if self.languages is None else ",".join(sorted(self.languages))


class _Shell:
    """Just enough of a shell's lexer to know whether a line is inside a here-document or an
    open quote (where a line of backticks is the command's text)."""

    def __init__(self) -> None:
        self.quote = ""                 # the open quote character, if any
        self.heredocs: list[str] = []   # delimiters still awaited, in order

    def inside(self) -> bool:
        return bool(self.quote or self.heredocs)

    def feed(self, line: str) -> None:
        if self.heredocs and not self.quote:
            if line.strip() == self.heredocs[0]:
                self.heredocs.pop(0)
            return
        starts = []  # offsets of the line outside quotes and comments
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if self.quote == "'":
                if c == "'":
                    self.quote = ""
            elif c == "\\":
                i += 1  # escapes the next character (in double quotes too)
            elif self.quote == '"':
                if c == '"':
                    self.quote = ""
            elif c in "'\"":
                self.quote = c
            elif c == "#" and (i == 0 or line[i - 1] in " \t;|&("):
                break  # a comment runs to the end of the line
            else:
                starts.append(i)
            i += 1
        plain = set(starts)
        self.heredocs += [m.group(2) for m in _HEREDOC.finditer(line) if m.start() in plain]


def fenced_blocks(text: str, base: int = 0) -> list[Block]:
    """The top-level fenced blocks of ``text`` (a block left open at the end is no block).
    A shell block that the shell reading leaves open to the end (an unpaired quote) closes
    at its first closing fence after all, and the reading goes on from there."""
    out: list[Block] = []
    opened: tuple[int, int, str] | None = None  # (start, fence length, language)
    shell: _Shell | None = None
    first_close: int | None = None  # the open shell block's first plain closing fence
    offset = 0
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        if opened is None:
            m = _OPEN.fullmatch(body)
            if m:
                info = m.group(2).split()
                opened = (offset, len(m.group(1)), info[0].lower() if info else "")
                shell = _Shell() if opened[2] in SHELLS else None
                first_close = None
        else:
            m = _CLOSE.fullmatch(body)
            closes = m is not None and len(m.group(1)) >= opened[1]
            if closes and not (shell and shell.inside()):
                out.append(Block(base + opened[0], base + offset + len(body), opened[2]))
                opened = None
            else:
                if closes and first_close is None:
                    first_close = offset + len(body)
                if shell is not None:
                    shell.feed(body)
        offset += len(line)
    if opened is not None and first_close is not None:
        out.append(Block(base + opened[0], base + first_close, opened[2]))
        out += fenced_blocks(text[first_close:], base + first_close)
    return out


def executed_blocks(text: str, rule: CodeRule, skipped: Counter[str] | None = None
                    ) -> list[Block]:
    """The blocks of one message that the harness ran; the others are counted in ``skipped``
    by language ('' for a block without one)."""
    blocks = fenced_blocks(text)
    ran = [b for b in blocks if rule.languages is None or b.language in rule.languages]
    if rule.blocks == "one" and len(ran) != 1:
        ran = []
    if skipped is not None:
        chosen = {b.start for b in ran}
        skipped.update(b.language for b in blocks if b.start not in chosen)
    return ran
