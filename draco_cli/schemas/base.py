"""The machinery of a table contract: a row model's columns, their Arrow types and JSON schema."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

import annotated_types
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import polars as pl

SCHEMA_VERSION = "1.0"


@dataclass(frozen=True)
class ArrowType:
    """Annotation marker pinning the Arrow type of a field (e.g. int32 rather than int64)."""

    type: pa.DataType


Int32 = Annotated[int, ArrowType(pa.int32())]


Float32 = Annotated[float, ArrowType(pa.float32())]


StepNumber = Annotated[int, ArrowType(pa.int32()), annotated_types.Ge(1)]


# The largest token count any one rollout may claim (response length, a step's tokens, an
# offset). Far above any model's context today (10M tokens), far below what would make a dense
# float32 layout of one rollout exhaust memory: a corrupt 2**31 - 1 is refused at read, before
# anything is allocated for it.
MAX_TOKENS = 1 << 24


Termination = Literal["submitted", "max_length", "max_turns", "env_error", "no_action"]


Verdict = Literal["pass", "fail", "na"]


CreditMode = Literal["step", "uniform", "grpo_fallback"]


class Table(BaseModel):
    """Base of every table row model."""

    model_config = ConfigDict(extra="allow")
    table_name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]]


@dataclass(frozen=True)
class Column:
    """What the contract says about one column, in a form the vectorised checks can use."""

    name: str
    arrow_type: pa.DataType
    nullable: bool
    required: bool
    choices: tuple[str, ...] | None
    ge: float | None
    description: str
    le: float | None = None
    item_ge: float | None = None  # bound on every element of a list column
    # Float columns (and lists of floats) never hold NaN or ±inf: a trainer fed one gets NaN
    # gradients, so every float a contract carries is checked finite wherever it is read.
    finite: bool = False


def _unwrap(annotation: object) -> tuple[object, bool, list[object]]:
    """Strip Optional and Annotated: (bare type, nullable, annotation metadata)."""
    nullable = False
    metadata: list[object] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            args = typing.get_args(annotation)
            annotation, metadata = args[0], metadata + list(args[1:])
        elif origin in (Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != len(typing.get_args(annotation)):
                nullable = True
            if len(members) != 1:
                raise TypeError(f"unsupported union {annotation!r}")
            annotation = members[0]
        else:
            return annotation, nullable, metadata


def arrow_type_of(annotation: object) -> pa.DataType:
    bare, _, metadata = _unwrap(annotation)
    for m in metadata:
        if isinstance(m, ArrowType):
            return m.type
    origin = typing.get_origin(bare)
    if origin is list:
        (item,) = typing.get_args(bare)
        return pa.list_(arrow_type_of(item))
    if origin is Literal or bare is str:
        return pa.string()
    if bare is bool:
        return pa.bool_()
    if bare is int:
        return pa.int64()
    if bare is float:
        return pa.float64()
    raise TypeError(f"no Arrow type for {bare!r}")


def _bound(value: object) -> float:
    """A Ge / Le bound of a contract as a float (annotated_types allows any comparable)."""
    if not isinstance(value, (int, float)):
        raise TypeError(f"unsupported bound {value!r}: a contract's bounds are numbers")
    return float(value)


@functools.cache
def columns(model: type[Table]) -> tuple[Column, ...]:
    """The contract's columns of ``model``, in order (computed once per model: resolving the
    type hints costs ~1 ms, and block-by-block writers ask for every block)."""
    hints = typing.get_type_hints(model, include_extras=True)
    out = []
    for attr, info in model.model_fields.items():
        name = info.alias or attr  # a column named like a Python keyword is an alias
        bare, nullable, _ = _unwrap(hints[attr])
        choices = tuple(typing.get_args(bare)) if typing.get_origin(bare) is Literal else None
        ge = le = item_ge = None
        for m in info.metadata:
            if isinstance(m, annotated_types.Ge):
                ge = _bound(m.ge)
            if isinstance(m, annotated_types.Le):
                le = _bound(m.le)
        if typing.get_origin(bare) is list:
            (item,) = typing.get_args(bare)
            for m in _unwrap(item)[2]:
                if isinstance(m, annotated_types.Ge):
                    item_ge = _bound(m.ge)
        arrow = arrow_type_of(hints[attr])
        value_type = arrow.value_type if pa.types.is_list(arrow) else arrow
        out.append(
            Column(
                name=name,
                arrow_type=arrow_type_of(hints[attr]),
                nullable=nullable,
                required=info.is_required(),
                choices=choices,
                ge=ge,
                description=info.description or "",
                le=le,
                item_ge=item_ge,
                finite=pa.types.is_floating(value_type),
            )
        )
    return tuple(out)


def arrow_schema(model: type[Table]) -> pa.Schema:
    fields = [
        pa.field(c.name, c.arrow_type, nullable=c.nullable, metadata={"doc": c.description})
        for c in columns(model)
    ]
    return pa.schema(
        fields,
        metadata={"draco.table": model.table_name, "draco.schema_version": SCHEMA_VERSION},
    )


def polars_schema(model: type[Table]) -> pl.Schema:
    """The contract's columns as a polars schema (name → dtype, in contract order), for building
    an empty or in-memory frame of that table; a fresh one, the caller may extend it."""
    import polars as pl

    return pl.Schema(_polars_schema(model))


@functools.cache
def _polars_schema(model: type[Table]) -> tuple[tuple[str, pl.DataType], ...]:
    import polars as pl   # loaded lazily: the CLI's start-up imports the contracts

    return tuple(pl.DataFrame(arrow_schema(model).empty_table()).schema.items())


def json_schema(model: type[Table]) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema["$id"] = f"draco/{model.table_name}/{SCHEMA_VERSION}"
    schema["x-draco-table"] = model.table_name
    schema["x-draco-schema-version"] = SCHEMA_VERSION
    schema["x-draco-keys"] = list(model.keys)
    return schema
