"""Where the CLI writes: data to stdout, messages and progress to stderr."""

import sys

from rich.console import Console

# Piped or captured output (CI logs, a training script's log file) gets a wide console instead
# of rich's 80-column default, so summary tables keep their words whole.
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
