"""Where the CLI writes: data to stdout, messages and progress to stderr."""

import sys

from rich.console import Console

# Piped or captured output (CI logs, a training script's log file) gets a wide console instead
# of rich's 80-column default, so summary tables keep their words whole.
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def remote_named(text: str) -> str:
    """``text`` with the local copies of remote paths (``s3://…``) shown as the URIs the user
    gave: a remote run's outputs are where it publishes them, not its cache."""
    from draco_cli import storage

    staging = storage.current.get(None)
    return staging.name_remote(text) if staging is not None else text
