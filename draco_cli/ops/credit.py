"""Credit operations (``draco credit compute`` / ``expand``): read rollouts, steps and
verdicts, compute rewards, step credit and token advantages, publish them as one set; convert
token advantages between their spans and dense forms."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli._allocator import arrow_pool, trim_heap
from draco_cli.credit import (VERDICT_ID_COLUMNS, CreditStats, clean_strings, compute_credit,
                              index_steps)
from draco_cli.errors import DracoError, InputError, OutputError, UsageError
from draco_cli.io import OutputSet, as_frame, check_writable, conform, read_arrow, read_table
from draco_cli.ops import publish_file, source_name
from draco_cli.options import CreditOptions
from draco_cli.schemas import (Reward, Rollout, Step, StepCredit, TokenAdvantages,
                               VerdictAggregated, columns)
from draco_cli.ops.credit_blocks import (LAYOUT_KEY, WholeTables, credit_by_blocks, layout_label,
                                         plan_blocks, token_form, with_step_ids)
from draco_cli.token_advantages import dense_to_spans, form_of, spans_to_dense

if TYPE_CHECKING:
    from draco_cli.validate import FlatSpans

CREDIT_ROLLOUT_COLUMNS = ["rollout_id", "group_id", "task_id", "outcome", "response_len",
                          "policy_spans", "train_step", "response_fingerprint"]
CREDIT_STEP_COLUMNS = ["rollout_id", "step", "n_tokens", "token_start"]
CREDIT_VERDICT_COLUMNS = ["rollout_id", "criterion_id", "judge", "verdict", "cited_steps",
                          "retained"]


def _check_spans_type(spans: pa.Array[Any] | None, source: str,
                      response_len: pl.Series | None = None) -> FlatSpans | None:
    """The policy_spans rules of ``draco validate``, raised at the first broken one; returns
    the spans flattened (views of the file's buffers) for the token step to reuse."""
    from draco_cli.validate import flat_policy_spans, policy_span_issues, raise_first

    if spans is None:
        return None
    flat = flat_policy_spans(spans)
    raise_first(policy_span_issues(spans, response_len, flat), source, "policy_spans")
    return flat


def _no_verdicts() -> pl.DataFrame:
    return pl.DataFrame(schema={"rollout_id": pl.String, "criterion_id": pl.String,
                                "judge": pl.String, "verdict": pl.String,
                                "cited_steps": pl.List(pl.Int32), "retained": pl.Boolean})


def _read_verdicts(path: str | Path) -> tuple[pl.DataFrame, pa.Table | None]:
    """The verdicts ``credit compute`` needs, checked against their contract (but for the
    keys, which ``compute_credit`` checks on integer codes). Their rollout_id, criterion_id
    and judge stay Arrow when all three are clean string columns (what the contract checks of
    them): returned apart, for ``compute_credit(verdict_ids=...)``, so millions of id strings
    are never converted to polars; otherwise they are checked and converted as before."""
    columns = list(dict.fromkeys([*VerdictAggregated.keys, *CREDIT_VERDICT_COLUMNS]))
    arrow = read_arrow(path, columns)
    ids = None
    if all(c in arrow.column_names and clean_strings(arrow.column(c))
           for c in VERDICT_ID_COLUMNS):
        apart = list(VERDICT_ID_COLUMNS)
        if _verdicts_as_contract(arrow):  # verdict and cited_steps stay Arrow too
            apart += ["verdict", "cited_steps"]
            if "retained" not in arrow.column_names:  # as conform would add it (keeps the height)
                arrow = arrow.append_column("retained", pa.nulls(arrow.num_rows, pa.bool_()))
        ids = arrow.select(apart)
        arrow = arrow.drop_columns(apart)
        columns = [c for c in columns if c not in apart]
    return conform(as_frame(arrow), VerdictAggregated, source_name(path), columns,
                   check_keys=False), ids


def _verdicts_as_contract(arrow: pa.Table) -> bool:
    """The verdicts' verdict and cited_steps pass the contract's checks as read, checked on
    the Arrow columns (no conversion to polars): verdict a string column of pass / fail / na
    or null, cited_steps a list of int32 without null lists or items, every item >= 1. False
    sends them through ``conform``, which names what is wrong."""
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


@contextlib.contextmanager
def _arrow_pool() -> Iterator[None]:
    """Arrow's jemalloc pool for the call, when the process runs on pyarrow's own default
    (mimalloc): at 1M rollouts credit peaked ~120 MiB lower on it, at no higher CPU (paired
    runs, docs/credit.md §6). A pool the caller chose (``draco run``'s system pool for its
    credit stage, ``ARROW_DEFAULT_MEMORY_POOL``) is kept; the previous pool is restored after,
    also on error."""
    previous = pa.default_memory_pool()
    pool = None
    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ and previous.backend_name == "mimalloc":
        with contextlib.suppress(NotImplementedError):  # a pyarrow built without jemalloc
            pool = pa.jemalloc_memory_pool()
    if pool is None:
        yield
        return
    with arrow_pool(pool):
        yield


def credit_compute(rollouts: str | Path, steps: str | Path, verdicts: str | Path | None,
                   out: str | Path, *, tokens: str | None = None, force: bool = False,
                   options: CreditOptions | None = None, **kwargs: Any) -> CreditStats:
    """Rewards, step credit and token advantages of ``rollouts`` into ``out``.

    ``options`` (or the same fields as keywords) says how; ``verdicts`` may be None only with
    ``reward="outcome"`` and uniform credit: the environment's outcome, no criteria filter.
    """
    with _arrow_pool():
        return _credit_compute(rollouts, steps, verdicts, out, tokens=tokens, force=force,
                               options=options, **kwargs)


def _credit_compute(rollouts: str | Path, steps: str | Path, verdicts: str | Path | None,
                    out: str | Path, *, tokens: str | None = None, force: bool = False,
                    options: CreditOptions | None = None, **kwargs: Any) -> CreditStats:
    if options is None:
        options = CreditOptions.build(**kwargs, **({"tokens": tokens} if tokens else {}))
    elif kwargs or tokens:
        raise TypeError("pass either options= or keyword options, not both")
    if verdicts is None and (options.reward != "outcome" or options.credit != "uniform"):
        raise UsageError("--verdicts is needed unless --reward outcome with --credit uniform "
                         "(no rubric: nothing to filter or spread credit by)")
    tokens = options.tokens
    out = Path(out)
    targets = [out / "rewards.parquet", out / "step_credit.parquet",
               out / "token_advantages.parquet"]
    for t in targets:
        check_writable(t, force)
    # policy_spans stays an Arrow column: converting millions of nested spans to polars
    # would cost more memory than all the credit computation.
    arrow = read_arrow(rollouts, CREDIT_ROLLOUT_COLUMNS)
    spans = None
    if "policy_spans" in arrow.column_names:
        # one contiguous copy, made once: the check and the token step work on its buffers
        # (and the file's chunks are freed with the column)
        spans = arrow.column("policy_spans").combine_chunks()
        arrow = arrow.drop_columns(["policy_spans"])
    r = conform(as_frame(arrow), Rollout, source_name(rollouts),
                [c for c in CREDIT_ROLLOUT_COLUMNS if c != "policy_spans"])
    del arrow
    flat_spans = _check_spans_type(spans, source_name(rollouts), r["response_len"])
    # compute_credit checks steps run 1..M per rollout, which implies unique keys.
    # read_table's checks, but the steps' rollout_id stays Arrow when it is a clean string
    # column (what the contract checks of it): steps in the rollouts' order are indexed on it
    # and step_credit is written from it, without converting 20M ids to polars and back.
    step_columns = list(dict.fromkeys([*Step.keys, *CREDIT_STEP_COLUMNS]))
    arrow = read_arrow(steps, step_columns)
    step_ids = arrow.column("rollout_id") if "rollout_id" in arrow.column_names else None
    if step_ids is not None and step_ids.null_count == 0 and (
            pa.types.is_string(step_ids.type) or pa.types.is_large_string(step_ids.type)):
        arrow = arrow.drop_columns(["rollout_id"])
        step_columns.remove("rollout_id")
    else:
        step_ids = None
    s = conform(as_frame(arrow), Step, source_name(steps), step_columns, check_keys=False)
    del arrow
    # compute_credit checks the verdicts' keys on integer codes (the string check costs more).
    v, v_ids = (_no_verdicts(), None) if verdicts is None else _read_verdicts(verdicts)
    plan = plan_blocks(r, s, step_ids, v, v_ids, options)
    if plan is not None:
        try:
            return credit_by_blocks(plan, r, spans, flat_spans, s, step_ids, v, v_ids, out,
                                    options=options, force=force,
                                    steps_source=source_name(steps),
                                    verdicts_source=source_name(verdicts or "verdicts"))
        except OutputError:
            raise
        except (WholeTables, DracoError):
            pass  # the whole-table computation below raises the error as it always has
        del plan
    sa = index_steps(s, r, source_name(steps), ids=step_ids)
    del s, step_ids  # the steps' own columns are copied or kept by sa: freed before the computation
    # No name here keeps the verdicts alive: compute_credit frees their columns as it is done
    # with them (arguments pass to the callee's frame).
    held: dict[str, Any] = {"verdicts": v, "ids": v_ids}
    del v, v_ids
    result = compute_credit(r, sa, held.pop("verdicts"), verdicts_source=source_name(verdicts or "verdicts"),
                            steps_source=source_name(steps), check_verdict_keys=True,
                            verdict_ids=held.pop("ids"),
                            **options.model_dump(exclude={"tokens"}))
    from draco_cli.token_advantages import token_spans

    rewards, step_credit, stats, sa = (result.rewards, result.step_credit, result.stats,
                                       result.steps)
    del result
    step_adv = step_credit["advantage"].to_numpy()
    # token_spans finds each step's rollout from the offsets: the per-step index (8 bytes a
    # step) goes before the writes instead of adding to their peak.
    sa.r = np.zeros(0, dtype=np.int64)
    # The computation's temporaries are freed; without this the allocator would keep them
    # and the writes below would stack their peak on top.
    trim_heap()
    with OutputSet(out, [t.name for t in targets], force=force) as output:
        # step_credit is written, then freed, before token advantages are built: the two
        # largest tables never coexist (an error below still publishes nothing).
        output.write_table(rewards, targets[0].name, Reward)
        output.write_table(with_step_ids(step_credit, sa.step_rollout_ids), targets[1].name,
                           StepCredit)
        del step_credit
        sa.step_rollout_ids = None
        trim_heap()
        ta = token_spans(r, sa, step_adv, rewards["advantage"].to_numpy(),
                         rewards["credit_mode"], source_name(steps), spans,
                         policy_flat=flat_spans)
        ta = token_form(ta, tokens)
        meta = {LAYOUT_KEY: layout_label(ta["layout"].unique().to_list()),
                "draco.token_form": tokens}
        output.write_table(ta, targets[2].name, TokenAdvantages, drop_absent_optional=True,
                           metadata=meta)
    return stats


def credit_expand(token_advantages: str | Path, out: str | Path, *,
                  rollouts: str | Path | None = None, to: str | None = None,
                  force: bool = False) -> str:
    """``token_advantages`` in the other form (or ``to``) → ``out``, exactly; returns the
    form written."""
    check_writable(out, force)
    ta = read_table(token_advantages, TokenAdvantages)
    from draco_cli.validate import raise_first, token_advantage_issues

    for field, issue in token_advantage_issues(ta)[:1]:
        raise_first([issue], source_name(token_advantages), field)
    present = [c for c in ("advantages", "span_start", "span_end", "span_value")
               if c in ta.columns and ta[c].null_count() < ta.height]
    ta = ta.select("rollout_id", "length", "layout", *present)
    if rollouts is not None:
        r = read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id"])
        missing = r.join(ta, on="rollout_id", how="anti")
        if missing.height:
            raise InputError(f"no token advantages for rollout {missing['rollout_id'][0]!r}",
                             file=source_name(token_advantages), field="rollout_id")
    form = form_of(ta)
    target = to or ("dense" if form == "spans" else "spans")
    if target == "dense":
        res = ta if form in ("dense", "both") else spans_to_dense(ta)
        res = res.drop("span_start", "span_end", "span_value", strict=False)
    elif target == "spans":
        res = ta if form in ("spans", "both") else dense_to_spans(ta)
        res = res.drop("advantages", strict=False)
    else:
        res = spans_to_dense(ta).with_columns(ta.select("span_start", "span_end", "span_value")) \
            if form == "spans" else dense_to_spans(ta).with_columns(ta.select("advantages"))
    publish_file(res, out, TokenAdvantages, force=force, drop_absent_optional=True,
                 metadata={"draco.token_form": target})
    return target
