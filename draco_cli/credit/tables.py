"""Credit's input tables as ``credit compute`` reads them (whole files or blocks of them) and
its step_credit as written: the contract checks, with the id columns kept in Arrow where they
are clean (millions of id strings never converted to polars and back)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.credit.inputs import VERDICT_ID_COLUMNS, clean_strings
from draco_cli.io import as_frame, conform
from draco_cli.schemas import Rollout, Step, VerdictAggregated, columns

if TYPE_CHECKING:
    from draco_cli.validate import FlatSpans

CREDIT_ROLLOUT_COLUMNS = ["rollout_id", "group_id", "task_id", "outcome", "response_len",
                          "policy_spans", "train_step", "response_fingerprint"]
CREDIT_STEP_COLUMNS = list(dict.fromkeys([*Step.keys, "rollout_id", "step", "n_tokens",
                                          "token_start"]))
CREDIT_VERDICT_COLUMNS = list(dict.fromkeys([*VerdictAggregated.keys, "rollout_id",
                                             "criterion_id", "judge", "verdict",
                                             "cited_steps", "retained"]))


def rollouts_frame(arrow: pa.Table, source: str,
                   ) -> tuple[pl.DataFrame, pa.Array[Any] | None, FlatSpans | None]:
    """(rollouts checked against their contract, policy_spans as one Arrow array, the spans
    flattened). policy_spans stays Arrow: converting millions of nested spans to polars would
    cost more memory than all the credit computation; its rules are ``draco validate``'s,
    raised at the first broken one."""
    from draco_cli.validate import flat_policy_spans, policy_span_issues, raise_first

    spans = flat = None
    if "policy_spans" in arrow.column_names:
        # one contiguous copy: the check and the token step work on its buffers
        spans = arrow.column("policy_spans").combine_chunks()
        arrow = arrow.drop_columns(["policy_spans"])
    r = conform(as_frame(arrow), Rollout, source,
                [c for c in CREDIT_ROLLOUT_COLUMNS if c != "policy_spans"])
    if spans is not None:
        flat = flat_policy_spans(spans)
        raise_first(policy_span_issues(spans, r["response_len"], flat), source, "policy_spans")
    return r, spans, flat


def steps_frame(arrow: pa.Table, source: str) -> tuple[pl.DataFrame, pa.ChunkedArray[Any] | None]:
    """(steps checked against their contract but for the keys, their rollout_id apart as
    Arrow when it is a clean string column). ``index_steps`` checks steps run 1..M per
    rollout, which implies unique keys."""
    step_columns = list(CREDIT_STEP_COLUMNS)
    ids = arrow.column("rollout_id") if "rollout_id" in arrow.column_names else None
    if clean_strings(ids):
        arrow = arrow.drop_columns(["rollout_id"])
        step_columns.remove("rollout_id")
    else:
        ids = None
    return conform(as_frame(arrow), Step, source, step_columns, check_keys=False), ids


def no_verdicts() -> pl.DataFrame:
    return pl.DataFrame(schema={"rollout_id": pl.String, "criterion_id": pl.String,
                                "judge": pl.String, "verdict": pl.String,
                                "cited_steps": pl.List(pl.Int32), "retained": pl.Boolean})


def verdicts_frame(arrow: pa.Table, source: str) -> tuple[pl.DataFrame, pa.Table | None]:
    """The verdicts checked against their contract but for the keys, which ``compute_credit``
    checks on integer codes. Their rollout_id, criterion_id and judge stay Arrow when all
    three are clean string columns: returned apart, for ``compute_credit(verdict_ids=...)``
    (with verdict and cited_steps when those pass the contract as read)."""
    cols = list(CREDIT_VERDICT_COLUMNS)
    ids = None
    if all(c in arrow.column_names and clean_strings(arrow.column(c))
           for c in VERDICT_ID_COLUMNS):
        apart = list(VERDICT_ID_COLUMNS)
        if _verdicts_as_contract(arrow):
            apart += ["verdict", "cited_steps"]
            if "retained" not in arrow.column_names:  # as conform would add it
                arrow = arrow.append_column("retained", pa.nulls(arrow.num_rows, pa.bool_()))
        ids = arrow.select(apart)
        arrow = arrow.drop_columns(apart)
        cols = [c for c in cols if c not in apart]
    return conform(as_frame(arrow), VerdictAggregated, source, cols, check_keys=False), ids


def _verdicts_as_contract(arrow: pa.Table) -> bool:
    """The verdicts' verdict and cited_steps pass the contract's checks as read, checked on
    the Arrow columns: verdict a string column of pass / fail / na or null, cited_steps a
    list of int32 without null lists or items, every item >= 1. False sends them through
    ``conform``, which names what is wrong."""
    if not {"verdict", "cited_steps"} <= set(arrow.column_names):
        return False
    verdict, cited = arrow.column("verdict"), arrow.column("cited_steps")
    if not (pa.types.is_string(verdict.type) or pa.types.is_large_string(verdict.type)):
        return False
    if not ((pa.types.is_list(cited.type) or pa.types.is_large_list(cited.type))
            and pa.types.is_int32(cited.type.value_type) and cited.null_count == 0):
        return False
    contract = {c.name: c for c in columns(VerdictAggregated)}
    item_ge, choices = contract["cited_steps"].item_ge, contract["verdict"].choices
    assert item_ge is not None and choices is not None  # what the checks below stand for
    values = pa.chunked_array([pc.list_flatten(chunk) for chunk in cited.chunks],
                              type=pa.int32())
    if values.null_count or (len(values) and pc.min(values).as_py() < item_ge):
        return False
    allowed = pa.array(choices, type=verdict.type)
    return bool(pc.all(pc.is_in(pc.drop_null(verdict), value_set=allowed)).as_py() is not False)


def with_step_ids(step_credit: pl.DataFrame,
                  ids: pl.Series | pa.ChunkedArray[Any] | None) -> pl.DataFrame | pa.Table:
    """step_credit with the steps' Arrow rollout_id as its first column when it was built
    without one (see ``StepArrays.step_rollout_ids``), as the large_string polars would write
    (the cast shares the strings, only offsets are new)."""
    if not isinstance(ids, pa.ChunkedArray):
        return step_credit
    return step_credit.to_arrow().add_column(0, "rollout_id", ids.cast(pa.large_string()))
