"""Incremental JSON reading: the elements of a top-level array, or of one array-valued key of a
top-level object, one at a time, so memory stays flat however large the log file is.

Built on ``json.JSONDecoder.raw_decode`` over a sliding text buffer; no extra dependency.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from draco_cli.errors import InputError

_CHUNK = 1 << 20
_WS = " \t\r\n"
_TOKEN_MAX = 64  # longest non-string token we expect to see cut by a chunk boundary
_decoder = json.JSONDecoder()


class JsonStream:
    def __init__(self, fp: TextIO, source: str, chunk: int = _CHUNK) -> None:
        self.fp = fp
        self.source = source
        self.chunk = chunk
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.consumed = 0  # characters dropped from the front of the buffer

    def _fill(self) -> bool:
        if self.eof:
            return False
        data = self.fp.read(self.chunk)
        if not data:
            self.eof = True
            return False
        self.consumed += self.pos
        self.buf = self.buf[self.pos :] + data
        self.pos = 0
        return True

    def peek(self) -> str:
        """Next non-whitespace character ('' at end of input)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return ""

    def expect(self, chars: str, where: str) -> str:
        ch = self.peek()
        if ch == "" or ch not in chars:
            found = "end of file" if ch == "" else repr(ch)
            raise InputError(
                f"invalid JSON: expected {' or '.join(repr(c) for c in chars)}, found {found}"
                f" at character {self.consumed + self.pos}",
                file=self.source,
                row=where,
            )
        self.pos += 1
        return ch

    def value(self, where: str) -> Any:
        """Decode the next complete JSON value, reading more input as needed."""
        if self.peek() not in ('{', '[', '"'):
            # A number or literal has no closing delimiter: make sure it is all in the buffer.
            while len(self.buf) - self.pos < _TOKEN_MAX and self._fill():
                pass
        while True:
            try:
                obj, end = _decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                # An error near the end of the buffer (a literal, number or escape cut in
                # two) or an unterminated string may just mean the value continues in the next
                # chunk; an error well before the end is a real one.
                incomplete = (exc.pos >= len(self.buf) - _TOKEN_MAX
                              or exc.msg.startswith("Unterminated"))
                if incomplete and self._fill():
                    continue
                what = "truncated JSON" if incomplete else f"invalid JSON ({exc.msg})"
                raise InputError(
                    f"{what} at character {self.consumed + exc.pos}",
                    file=self.source,
                    row=where,
                ) from None
            except RecursionError:
                raise InputError("JSON nested too deeply to be a log entry",
                                 file=self.source, row=where) from None
            self.pos = end
            return obj

    def array_items(self, label: Callable[[int], str]) -> Iterator[tuple[int, Any]]:
        """Yield (index, element) of the array starting at the current position."""
        self.expect("[", label(0))
        index = 0
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            yield index, self.value(label(index))
            index += 1
            if self.expect(",]", label(index)) == "]":
                return

    def end(self) -> None:
        if self.peek() != "":
            raise InputError(
                f"unexpected data after the end of the JSON document at character "
                f"{self.consumed + self.pos}",
                file=self.source,
            )


def iter_array(fp: TextIO, source: str, label: Callable[[int], str]) -> Iterator[tuple[int, Any]]:
    """Elements of a file whose top level is a JSON array."""
    stream = JsonStream(fp, source)
    yield from stream.array_items(label)
    stream.end()


def iter_object_with_array(
    fp: TextIO, source: str, array_key: str, label: Callable[[int], str]
) -> Iterator[tuple[str, Any]]:
    """Walk a top-level JSON object: yield (key, value) for every key, except that the value
    of ``array_key`` is streamed as ``(array_key, (index, element))`` pairs, one per element.
    """
    stream = JsonStream(fp, source)
    stream.expect("{", "top level")
    if stream.peek() == "}":
        stream.pos += 1
        stream.end()
        return
    while True:
        key = stream.value("top level")
        if not isinstance(key, str):
            raise InputError("invalid JSON: object key is not a string", file=source)
        stream.expect(":", f"key '{key}'")
        if key == array_key:
            for item in stream.array_items(label):
                yield key, item
        else:
            yield key, stream.value(f"key '{key}'")
        if stream.expect(",}", "top level") == "}":
            break
    stream.end()
