"""One error hierarchy for the library; the CLI maps it to messages and exit codes."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager


class DracoError(Exception):
    """Base of every error draco raises on purpose. Exit code 1 at the command line."""

    exit_code = 1


class UsageError(DracoError):
    """The call itself is wrong (options that do not fit together). Exit code 2."""

    exit_code = 2


class InputError(DracoError):
    """Bad input data, located as precisely as we can: file, row (or entry) and field."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        row: int | str | None = None,
        field: str | None = None,
    ) -> None:
        self.file = file
        self.row = row
        self.field = field
        self.detail = message
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.file is not None:
            where.append(str(self.file))
        if self.row is not None:
            where.append(self.row if isinstance(self.row, str) else f"row {self.row}")
        if self.field is not None:
            where.append(f"field '{self.field}'")
        return (": ".join(where) + ": " if where else "") + self.detail


class OutputExistsError(DracoError):
    """Refusing to overwrite an existing output without --force."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} already exists; pass --force to overwrite it")


class ValidationFailed(DracoError):
    """A set of tables broke their contracts; its message lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        head = f"{len(problems)} problem(s) found"
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in problems))


class OutputError(DracoError):
    """Writing an output failed (no space, no permission, read-only, ...); nothing was
    published, and what existed before is as it was."""


class Interrupted(DracoError):
    """Stopped by Ctrl-C; the message says how to resume. Exit code 130."""

    exit_code = 130


# One wording per OSError family, used at the command-line edge and where a write knows its
# path: new commands inherit it without a line of their own.
_OS_ERRORS = {
    errno.ENOSPC: "no space left on the device (nothing was written; free space and rerun)",
    errno.EDQUOT: "disk quota exceeded (nothing was written)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of this path is a file, not a folder",
    errno.EISDIR: "is a folder, expected a file",
    errno.ENOENT: "no such file or folder",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "file name too long",
    errno.EMFILE: "too many open files",
    errno.EIO: "input/output error",
}


def describe_os_error(exc: OSError, path: str | os.PathLike[str] | None = None) -> str:
    """One line: the path (the one given, else the one the error names) and what happened."""
    what = _OS_ERRORS.get(exc.errno) if exc.errno is not None else None
    if what is None:
        what = exc.strerror or str(exc) or type(exc).__name__
        # pyarrow reports "IOError: [Errno 28] ..." in its message with errno unset
        for code, text in _OS_ERRORS.items():
            if f"[Errno {code}]" in str(exc) or f"(os error {code})" in str(exc):
                what = text
                break
    where = path if path is not None else exc.filename
    if exc.filename2 is not None and path is None:
        where = f"{exc.filename} -> {exc.filename2}"
    return f"{where}: {what}" if where is not None else what


@contextmanager
def naming(file: str | os.PathLike[str] | None, row: int | str | None = None
           ) -> Iterator[None]:
    """An InputError raised inside without a file gets ``file`` (code that checks a frame does
    not know which file it was read from), and ``row`` if given."""
    try:
        yield
    except InputError as exc:
        if exc.file is not None or file is None:
            raise
        raise InputError(exc.detail, file=str(file), row=exc.row if row is None else row,
                         field=exc.field) from None
