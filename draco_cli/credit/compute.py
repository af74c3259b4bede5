"""``draco credit compute`` / ``expand`` (docs/credit.md). Inputs that take blocks go to
``credit.blocks``; any others, and any error a block raises, take the whole-table computation
here (docs/credit.md §6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.credit.blocks import WholeTables, credit_by_blocks, plan_blocks
from draco_cli.credit.core import CreditStats, compute_credit
from draco_cli.credit.inputs import StepArrays, index_steps
from draco_cli.credit.tables import (CREDIT_ROLLOUT_COLUMNS, CREDIT_STEP_COLUMNS,
                                     CREDIT_VERDICT_COLUMNS, no_verdicts, rollouts_frame,
                                     steps_frame, verdicts_frame, with_step_ids)
from draco_cli.credit.tokens import (LAYOUT_KEY, SPAN_COLUMNS, dense_to_spans, layout_label,
                                     spans_to_dense, token_form, token_spans)
from draco_cli.errors import DracoError, InputError, OutputError, UsageError
from draco_cli.io import OutputSet, check_writable, read_arrow, read_table
from draco_cli.publish import publish_file, source_name
from draco_cli.options import CreditOptions
from draco_cli.schemas import Reward, Rollout, RubricDropout, StepCredit, TokenAdvantages

OUTPUTS = ("rewards.parquet", "step_credit.parquet", "token_advantages.parquet")
DROPOUT = "rubric_dropout.parquet"   # written with --rubric-dropout P > 0 only


def credit_compute(rollouts: str | Path, steps: str | Path, verdicts: str | Path | None,
                   out: str | Path, *, tokens: str | None = None, force: bool = False,
                   options: CreditOptions | None = None, block_rollouts: int | None = None,
                   **kwargs: Any) -> CreditStats:
    """Rewards, step credit and token advantages of ``rollouts`` into ``out``.

    ``options`` (or the same fields as keywords) says how; ``verdicts`` may be None only with
    ``reward="outcome"`` and uniform credit: the environment's outcome, no criteria filter.
    ``block_rollouts`` bounds the rollouts of one block (``blocks.BLOCK_ROLLOUTS`` by default):
    smaller blocks hold less at once and cost a little more per row.
    """
    if options is None:
        options = CreditOptions.build(**kwargs, **({"tokens": tokens} if tokens else {}))
    elif kwargs or tokens:
        raise TypeError("pass either options= or keyword options, not both")
    if verdicts is None and (options.reward != "outcome" or options.credit != "uniform"):
        raise UsageError("--verdicts is needed unless --reward outcome with --credit uniform "
                         "(no rubric: nothing to filter or spread credit by)")
    out = Path(out)
    for name in (*OUTPUTS, DROPOUT):
        check_writable(out / name, force)
    # dropout takes the whole-table computation (its table is made in one piece)
    plan = None if options.rubric_dropout > 0 else \
        plan_blocks(rollouts, steps, verdicts, block_rollouts)
    if plan is not None:
        try:
            stats = credit_by_blocks(plan, rollouts, steps, verdicts, out, options=options,
                                     force=force)
            (out / DROPOUT).unlink(missing_ok=True)   # as _whole_tables: none without dropout
            return stats
        except OutputError:
            raise
        except (WholeTables, DracoError):
            pass  # the whole-table computation below raises the error as it always has
    return _whole_tables(rollouts, steps, verdicts, out, options=options, force=force)


def check_inputs(rollouts: str | Path, steps: str | Path
                 ) -> tuple[Any, Any, Any, StepArrays]:
    """The checks ``credit_compute`` makes of the rollouts and steps, made on their own:
    ``draco run`` calls it before its LLM stages, so a bad table is named before a call is
    paid for (measured cost: docs/decisions.md, "A new user's pass"). Returns what it read."""
    r, spans, flat_spans = rollouts_frame(read_arrow(rollouts, CREDIT_ROLLOUT_COLUMNS),
                                          source_name(rollouts))
    s, step_ids = steps_frame(read_arrow(steps, CREDIT_STEP_COLUMNS), source_name(steps))
    # the steps' own columns are copied or kept by the index: freed when this returns
    return r, spans, flat_spans, index_steps(s, r, source_name(steps), ids=step_ids)


def _whole_tables(rollouts: str | Path, steps: str | Path, verdicts: str | Path | None,
                  out: Path, *, options: CreditOptions, force: bool) -> CreditStats:
    r, spans, flat_spans, sa = check_inputs(rollouts, steps)
    # Read in the call, so no name here keeps the verdicts alive: compute_credit frees their
    # columns as it is done with them.
    result = compute_credit(r, sa, no_verdicts() if verdicts is None else verdicts_frame(
                                read_arrow(verdicts, CREDIT_VERDICT_COLUMNS),
                                source_name(verdicts)),
                            verdicts_source=source_name(verdicts or "verdicts"),
                            steps_source=source_name(steps), check_verdict_keys=True,
                            **options.credit_args())
    rewards, step_credit, stats, sa = (result.rewards, result.step_credit, result.stats,
                                       result.steps)
    dropout = result.dropout
    del result
    step_adv = step_credit["advantage"].to_numpy()
    # token_spans finds each step's rollout from the offsets: the per-step index (8 bytes a
    # step) goes before the writes instead of adding to their peak.
    sa.r = np.zeros(0, dtype=np.int64)
    names = [*OUTPUTS, DROPOUT] if dropout is not None else list(OUTPUTS)
    with OutputSet(out, names, force=force) as output:
        # step_credit is written, then freed, before token advantages are built: the two
        # largest tables never coexist (an error below still publishes nothing).
        output.write_table(rewards, OUTPUTS[0], Reward)
        output.write_table(with_step_ids(step_credit, sa.step_rollout_ids), OUTPUTS[1],
                           StepCredit)
        del step_credit
        sa.step_rollout_ids = None
        ta = token_spans(r, sa, step_adv, rewards["advantage"].to_numpy(),
                         rewards["credit_mode"], source_name(steps), spans,
                         policy_flat=flat_spans)
        ta = token_form(ta, options)
        meta = {LAYOUT_KEY: layout_label(ta["layout"].unique().to_list()),
                "draco.token_form": options.tokens}
        output.write_table(ta, OUTPUTS[2], TokenAdvantages, drop_absent_optional=True,
                           metadata=meta)
        if dropout is not None:
            output.write_table(dropout, DROPOUT, RubricDropout)
    if dropout is None:   # a table left by an earlier run with dropout would now be wrong
        (out / DROPOUT).unlink(missing_ok=True)
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
    # the self-check columns ride along: a loader given the expanded file checks a trainer's
    # rows exactly as it would with the original
    checks = [c for c in ("train_step", "n_policy_tokens", "response_fingerprint")
              if c in ta.columns]
    ta = ta.select("rollout_id", "length", "layout", *checks, *present)
    if rollouts is not None:
        r = read_table(rollouts, Rollout, columns=["rollout_id", "group_id", "task_id"])
        missing = r.join(ta, on="rollout_id", how="anti")
        if missing.height:
            raise InputError(f"no token advantages for rollout {missing['rollout_id'][0]!r}",
                             file=source_name(token_advantages), field="rollout_id")
    dense, spans = "advantages" in present, set(SPAN_COLUMNS) <= set(present)
    form = ("both" if spans else "dense") if dense else "spans"
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
                 metadata={"draco.token_form": target,
                           LAYOUT_KEY: layout_label(ta["layout"].unique().to_list())})
    return target
