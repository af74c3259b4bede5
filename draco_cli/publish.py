"""How the operations publish their outputs: a single file or several checked tables, each
write one output set (docs/data-contracts.md, "Output sets")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draco_cli.errors import UsageError
from draco_cli.io import STDIO, OutputSet, write_table
from draco_cli.schemas import Table


def source_name(path: str | Path) -> str:
    """How an input is named in errors: its path, or <stdin> for ``-``."""
    return "<stdin>" if str(path) == STDIO else str(path)


def publish_file(df: Any, out: str | Path, model: type[Table], *, force: bool = False,
                 **kwargs: Any) -> None:
    """One output file published as a one-member output set (``-`` streams the table to stdout
    instead)."""
    if str(out) == STDIO:
        write_table(df, out, model, force=force, **kwargs)
        return
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"{out}: is a folder, expected a file name")
    with OutputSet(out.parent, [out.name], force=force, option="output folder") as output:
        output.write_table(df, out.name, model, **kwargs)


def checked(df: Any, model: type[Table], where: str) -> Any:
    """``df`` held to ``model``'s contract before it is written: NaN becomes null, a value
    outside the contract is refused naming the output (docs/data-contracts.md)."""
    import polars as pl

    from draco_cli.io import conform

    floats = [n for n, t in df.schema.items() if t in (pl.Float32, pl.Float64)]
    if floats:
        df = df.with_columns(pl.col(c).fill_nan(None) for c in floats)
    return conform(df, model, where)


def publish_tables(out: str | Path, tables: dict[str, tuple[Any, type[Table]]], *,
                   force: bool = False) -> dict[str, Any]:
    """Several tables (name → (frame, contract)) checked against their contracts and published
    into ``out`` as one locked output set with one set id: all of them appear, or none.
    Returns the frames as written (name → frame)."""
    out = Path(out)
    names = [f"{name}.parquet" for name in tables]
    frames = {f"{name}.parquet": (checked(df, model, str(out / f"{name}.parquet")), model)
              for name, (df, model) in tables.items()}
    with OutputSet(out, names, force=force) as output:
        for name, (df, model) in frames.items():
            output.write_table(df, name, model)
    return {name.removesuffix(".parquet"): df for name, (df, _) in frames.items()}
