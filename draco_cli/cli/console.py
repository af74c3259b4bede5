"""Where the CLI writes: data to stdout, messages and progress to stderr."""

from rich.console import Console

err_console = Console(stderr=True)
