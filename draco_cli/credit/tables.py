"""Credit's input tables as ``credit compute`` reads them (whole files or blocks of them) and
its step_credit as written: the contract checks, with the steps' rollout_id kept in Arrow where
it is clean (20M id strings never converted to polars and back)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import polars as pl
import pyarrow as pa

from draco_cli.credit.inputs import clean_strings
from draco_cli.io import as_frame, conform
from draco_cli.schemas import Rollout, Step, VerdictAggregated, polars_schema

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
        raise_first(policy_span_issues(spans, r["response_len"]), source, "policy_spans")
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
    return pl.DataFrame(schema=polars_schema(VerdictAggregated))


def verdicts_frame(arrow: pa.Table, source: str) -> pl.DataFrame:
    """The verdicts checked against their contract but for the keys, which ``compute_credit``
    checks on integer codes."""
    return conform(as_frame(arrow), VerdictAggregated, source, CREDIT_VERDICT_COLUMNS,
                   check_keys=False)


def with_step_ids(step_credit: pl.DataFrame,
                  ids: pl.Series | pa.ChunkedArray[Any] | None) -> pl.DataFrame | pa.Table:
    """step_credit with the steps' Arrow rollout_id as its first column when it was built
    without one (see ``StepArrays.step_rollout_ids``), as the large_string polars would write
    (the cast shares the strings, only offsets are new)."""
    if not isinstance(ids, pa.ChunkedArray):
        return step_credit
    return step_credit.to_arrow().add_column(0, "rollout_id", ids.cast(pa.large_string()))
