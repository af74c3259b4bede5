"""``draco run --spot-check N``: the spot-check stage of a run folder (``judge.spot``), after
the credit stage; its key, its manifest record and settings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from draco_cli.llm.answered import Answered
from draco_cli.run.folder import RunFolder, StageRecord

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.options import RunOptions
    from draco_cli.prompts.render import RenderOptions

CALL_LOG = "spot_check_calls.sqlite"   # the gold judge's own call log


def checked_gold(opts: RunOptions, gold: LLMSettings | None) -> LLMSettings | None:
    """The gold judge's settings, online unless asked otherwise (a step cannot wait hours)."""
    from dataclasses import replace

    from draco_cli.errors import UsageError

    if (opts.spot_check > 0) != (gold is not None):
        raise UsageError("--spot-check N needs --spot-check-model, and --spot-check-model "
                         "needs --spot-check N with N > 0")
    return replace(gold, batch=False) if gold is not None and gold.batch is None else gold


def settings(opts: RunOptions, gold: LLMSettings, run_dir: Path) -> dict[str, Any]:
    return {"spot_check": opts.spot_check, "spot_check_seed": opts.spot_check_seed,
            "spot_check_model": gold.model, "spot_check_base_url": gold.base_url,
            "spot_check_call_log": str((run_dir / CALL_LOG).absolute())}


def stage(rollouts: Path, steps: Path, folder: RunFolder, gold: LLMSettings, opts: RunOptions,
          train_step: int | None, render: RenderOptions) -> StageRecord:
    from draco_cli.judge.spot import spot_check_files

    _, report = spot_check_files(
        rollouts, steps, folder.table("rubrics"), folder.table("verdicts"),
        folder.table("spot_checks"), gold, n=opts.spot_check, seed=opts.spot_check_seed,
        train_step=train_step, render=render, max_tokens=opts.prompt.max_tokens,
        call_log=folder.path / CALL_LOG, drop=opts.credit.drop)
    st = report.phases.get("score")
    figure = Answered.of(report.phases.values())
    unanswered = figure.requests - figure.answered
    # no health record: an unanswered gold call leaves the stage partial, never the step
    # unhealthy (the reward does not depend on it)
    status = ("budget reached" if report.budget_reached else
              "done" if unanswered == 0 else "partial")
    calls = {"calls_new": (st.answered + st.unanswered) if st else 0,
             "calls_reused": st.cached if st else 0,
             "cost_usd": (round(st.cost_usd, 6) if st.priced else None) if st else 0.0,
             "priced": st.priced if st else True, "unanswered": unanswered}
    return StageRecord(key="", status=status, notes=report.notes, rows=report.rows,
                       calls=calls)
