"""The ``draco/…`` metrics of one training step, flat floats for the trainer's logger; the
list is in docs/inloop.md ("Metrics"). ``unanswered_share`` is 1 − ``draco_cli.llm.answered``
(the figure ``draco run --min-answered`` checks, reused calls included); ``credit_mode/<mode>``
is one of step, uniform, grpo_fallback, or ``none`` for a zero fallback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from draco_cli.inloop.scorer import GroupScore

__all__ = ["NoSignalWarning", "signal_problem", "step_metrics"]


def step_metrics(groups: list[GroupScore], rows: Mapping[str, Any], fallbacks: Mapping[str, str],
                 seconds: float, min_signal: float = 0.0) -> dict[str, float]:
    answered = sum(g.calls.answered for g in groups)
    cached = sum(g.calls.cached for g in groups)
    unanswered = sum(g.calls.unanswered for g in groups)
    from draco_cli.llm.answered import Answered

    figure = Answered(answered + cached, answered + cached + unanswered)
    kept = total = 0
    for g in groups:
        v = g.verdicts
        if v.height and "retained" in v.columns:
            import polars as pl

            per = v.group_by("criterion_id").agg(pl.col("retained").fill_null(False).any())
            total += per.height
            kept += int(per["retained"].sum())
        else:
            total += g.rubrics.height
    n = len(rows)
    nonzero = sum(bool((r.values != 0).any()) for r in rows.values())
    modes: dict[str, int] = {}
    for r in rows.values():
        modes[r.credit_mode] = modes.get(r.credit_mode, 0) + 1
    out = {
        "draco/groups": float(len(groups) + len(fallbacks)),
        "draco/rollouts": float(n),
        "draco/judge_calls": float(answered),
        "draco/cached_calls": float(cached),
        "draco/unanswered_share": 1.0 - figure.share,
        "draco/cost_usd": float(sum(g.calls.cost_usd for g in groups)),
        "draco/criteria_kept": float(kept),
        "draco/criteria_total": float(total),
        "draco/nonzero_share": nonzero / n if n else 0.0,
        "draco/fallback_groups": float(len(fallbacks)),
        "draco/fallback_rollouts": float(sum(1 for r in rows.values()
                                             if r.source.startswith("fallback"))),
        "draco/seconds_to_advantages": float(seconds),
    }
    out.update({f"draco/credit_mode/{m}": c / n for m, c in sorted(modes.items()) if m})
    out["draco/signal_ok"] = 0.0 if signal_problem(out, min_signal) else 1.0
    return out


class NoSignalWarning(UserWarning):
    """A train step gives the trainer no learning signal (``draco/signal_ok`` is 0)."""


def signal_problem(metrics: Mapping[str, float], min_signal: float = 0.0) -> str | None:
    """Why a step gives the trainer no learning signal, or None when it does."""
    n = metrics.get("draco/rollouts", 0.0)
    if not n:
        return "no rollouts were scored"
    share = metrics.get("draco/nonzero_share", 0.0)
    if metrics.get("draco/criteria_total", 0.0) and not metrics.get("draco/criteria_kept", 0.0):
        return (f"every one of the {metrics['draco/criteria_total']:g} criteria was dropped by "
                "the filter (every rollout passed or failed each alike): every advantage is 0")
    if share == 0:
        return (f"no rollout of {n:g} has a non-zero advantage: the step gives the trainer no "
                "learning signal")
    if share <= min_signal:
        return (f"only {share:.1%} of rollouts have a non-zero advantage (minimum signal "
                f"{min_signal:.1%}): the step gives the trainer almost no learning signal")
    return None
