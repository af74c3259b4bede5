"""The operations layer: one module per noun (ingest, rubric, judge, credit, audit, evaluate,
replay, run). Each operation reads its inputs, calls the pure functions of the library and
publishes its outputs as one set; the CLI commands and the Python API are thin layers over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draco_cli.errors import UsageError
from draco_cli.io import STDIO, OutputSet, write_table
from draco_cli.schemas import Table


def source_name(path: str | Path | None, default: str = "input") -> str:
    """How an input is named in errors: its path, or <stdin> for ``-``."""
    if path is None:
        return default
    return "<stdin>" if str(path) == STDIO else str(path)


def publish_file(df: Any, out: str | Path, model: type[Table], *, force: bool = False,
                 **kwargs: Any) -> None:
    """One output file published as a one-member output set: written to the folder's staging
    area under its lock and renamed into place, carrying a set id like every other output
    (``-`` streams the table to stdout instead)."""
    if str(out) == STDIO:
        write_table(df, out, model, force=force, **kwargs)
        return
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"{out}: is a folder, expected a file name")
    with OutputSet(out.parent, [out.name], force=force, option="output folder") as output:
        output.write_table(df, out.name, model, **kwargs)
