"""Where the CLI writes: data to stdout, messages and progress to stderr."""

import sys
from typing import Any

from rich.console import Console


class _Console(Console):
    """A console whose messages name remote outputs by their URIs, not their local copies."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*(remote_named(o) if isinstance(o, str) else o for o in objects),
                      **kwargs)


# Piped or captured output (CI logs, a training script's log file) gets a wide console instead
# of rich's 80-column default, so summary tables keep their words whole, and messages are not
# wrapped (a grep finds a message whole).
_PIPED = not sys.stderr.isatty()
err_console = _Console(stderr=True, width=160 if _PIPED else None, soft_wrap=_PIPED)


def remote_named(text: str) -> str:
    """``text`` with the local copies of remote paths (``s3://…``) shown as the URIs the user
    gave: a remote run's outputs are where it publishes them, not its cache."""
    from draco_cli import storage

    staging = storage.current.get(None)
    return staging.name_remote(text) if staging is not None else text
