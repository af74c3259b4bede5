"""Atomic files: a temporary file in the destination folder, then ``os.replace``; never over an existing file unless forced."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from draco_cli.errors import (
    OutputError,
    OutputExistsError,
    UsageError,
    describe_os_error,
)

STDIO = "-"


def check_writable(path: str | os.PathLike[str], force: bool) -> None:
    """Raise before any work is done if ``path`` exists and may not be replaced."""
    if str(path) != STDIO and Path(path).exists() and not force:
        raise OutputExistsError(str(path))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    dest = Path(path)
    if dest.is_dir():
        raise UsageError(f"{dest}: is a folder, expected a file name")
    check_writable(dest, force)
    prepare_out_dir(dest.parent, "output folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as exc:
        raise OutputError(describe_os_error(exc, dest)) from None
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates the file 0600; give the output the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OutputError(describe_os_error(exc, dest)) from None
        raise


def prepare_out_dir(out: str | os.PathLike[str], option: str = "-o") -> Path:
    """Create the output folder, or say in one line why it cannot be one."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{option} {out}: is a file, expected a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        parent = next((p for p in out.parents if p.exists() and not p.is_dir()), out.parent)
        raise UsageError(f"{option} {out}: {parent} is a file, not a folder") from None
    return out


def write_text_atomic(path: str | os.PathLike[str], text: str, force: bool = False) -> None:
    with atomic_path(path, force) as tmp:
        tmp.write_text(text, encoding="utf-8")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
