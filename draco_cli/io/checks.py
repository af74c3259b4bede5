"""Tables held to their contracts: types cast, ranges, finiteness and uniqueness checked with
whole-column operations, the first offending row named with file, row and field."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import polars as pl
import pyarrow as pa

from draco_cli.errors import (
    InputError,
)
from draco_cli.schemas import Column, Table, columns


def conform(
    df: pl.DataFrame, model: type[Table], source: str, only: list[str] | None = None,
    check_keys: bool = True,
) -> pl.DataFrame:
    """Check a frame against the contract of ``model`` and cast it to the contract's types.

    Raises InputError naming ``source``, the first offending row (0-based, as DuckDB and polars
    number them) and the field. ``only`` limits the checks to those columns.
    """
    for col in columns(model):
        if only is not None and col.name not in only:
            continue
        if col.name not in df.columns:
            if col.required:
                raise InputError(
                    f"missing required column of table '{model.table_name}'",
                    file=source,
                    field=col.name,
                )
            df = df.with_columns(pl.lit(None).alias(col.name))
        df = _cast_column(df, col, source)
        _check_column(df, col, source)
    if check_keys:
        _check_unique(df, model, source)
    return df


def _number(value: object) -> float:
    """A numeric column's min or max; 0 for an empty or all-null column."""
    return value if isinstance(value, (int, float)) else 0


def _cast_column(df: pl.DataFrame, col: Column, source: str) -> pl.DataFrame:
    target = cast(pl.Series, pl.from_arrow(pa.array([], type=col.arrow_type))).dtype
    if df.schema[col.name] == target:
        return df
    try:
        return df.with_columns(pl.col(col.name).cast(target, strict=True))
    except Exception:  # polars raises several exception types for failed casts
        bad = df.with_row_index("__row").filter(
            pl.col(col.name).cast(target, strict=False).is_null() & pl.col(col.name).is_not_null()
        )
        row = int(bad["__row"][0]) if bad.height else None
        value = bad[col.name][0] if bad.height else None
        raise InputError(
            f"expected {col.arrow_type}, got {df.schema[col.name]}"
            + (f" (value {value!r})" if value is not None else ""),
            file=source,
            row=row,
            field=col.name,
        ) from None


def _first_row(df: pl.DataFrame, mask: pl.Expr) -> int | None:
    hit = df.select(mask.arg_true().first()).item()
    return None if hit is None else int(hit)


def _check_column(df: pl.DataFrame, col: Column, source: str) -> None:
    c = pl.col(col.name)
    values = df[col.name]

    def refuse(mask: pl.Expr, message: Callable[[Any], str]) -> None:
        row = _first_row(df, mask)
        if row is not None:
            raise InputError(message(values[row]), file=source, row=row, field=col.name)

    # Cheap whole-column tests first; the offending row is looked for only on failure.
    if not col.nullable and values.null_count():
        refuse(c.is_null(), lambda _: "must not be null")
    if (choices := col.choices) is not None:
        refuse(c.is_not_null() & ~c.is_in(list(choices)),
               lambda v: f"{v!r} is not one of {', '.join(choices)}")
    if (ge := col.ge) is not None and _number(values.min()) < ge:
        refuse(c.is_not_null() & (c < ge), lambda v: f"must be >= {ge:g}, got {v}")
    if (le := col.le) is not None and _number(values.max()) > le:
        refuse(c.is_not_null() & (c > le),
               lambda v: f"implausible value {v} (more than {le:.0f}); refusing it before "
               "allocating anything for it")
    is_list = isinstance(df.schema[col.name], pl.List)
    if (item_ge := col.item_ge) is not None and is_list and df.height:
        low = values.list.min().min()
        if isinstance(low, (int, float)) and low < item_ge:
            refuse(c.list.min() < item_ge,
                   lambda v: f"every element must be >= {item_ge:g}, got {v.to_list()}")
    if col.finite:
        require_finite(df, [col.name], source)


def first_non_finite(df: pl.DataFrame, name: str) -> int | None:
    """Row of the first NaN or ±inf in a float (or list-of-float) column; None if all finite.

    One whole-column pass; nulls are not this check's business (nullability is)."""
    s = df[name]
    if isinstance(s.dtype, pl.List):
        flat = s.explode()
        if not flat.dtype.is_float() or flat.is_finite().fill_null(True).all():
            return None
        return _first_row(df, pl.col(name).list.eval(~pl.element().is_finite()).list.any())
    if not s.dtype.is_float() or s.is_finite().fill_null(True).all():
        return None
    return _first_row(df, ~pl.col(name).is_finite())


def require_finite(df: pl.DataFrame, names: list[str] | tuple[str, ...], source: str) -> None:
    """Raise InputError at the first NaN or ±inf in any of ``names`` (columns it has)."""
    for name in names:
        if name in df.columns:
            row = first_non_finite(df, name)
            if row is not None:
                value = df[name][row]
                if isinstance(value, pl.Series):   # a list: its first non-finite element
                    value = next(x for x in value.to_list()
                                 if x is not None and not math.isfinite(x))
                raise InputError(f"must be a finite number, got {value}", file=source,
                                 row=row, field=name)


def _check_unique(df: pl.DataFrame, model: type[Table], source: str) -> None:
    keys = list(model.keys)
    if df.height == 0 or not keys:  # a keyless table (one row of figures) has no duplicates
        return
    # Fast path: distinct hashes mean distinct keys (a collision only costs the exact check).
    if df.select(pl.struct(keys).hash().n_unique()).item() == df.height:
        return
    # Name the repeat, not the first occurrence: that is the row a user must look at.
    dup = df.select((~pl.struct(keys).is_first_distinct()).arg_true().first()).item()
    if dup is not None:
        row = int(dup)
        key = ", ".join(f"{k}={df[k][row]!r}" for k in keys)
        raise InputError(
            f"duplicate key ({key}) of table '{model.table_name}'",
            file=source,
            row=row,
            field=keys[-1] if len(keys) == 1 else "(" + ", ".join(keys) + ")",
        )
