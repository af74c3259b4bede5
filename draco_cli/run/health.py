"""A run's health record: whether its LLM stages were answered (``--min-answered``) and whether
the step gives the trainer a learning signal (``--min-signal``, ``--allow-no-signal``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draco_cli.llm.answered import Answered
from draco_cli.options import RunOptions
from draco_cli.run.folder import Health, StageHealth, StageRecord


def stage_figure(health: Mapping[str, Any] | None) -> Answered | None:
    """The answered figure of a stage's health record (``calls`` in manifests before the
    figure was named; those counted the same requests)."""
    if not health:
        return None
    return Answered(int(health["answered"]), int(health.get("requests", health.get("calls", 0))))


def run_health(stages: Mapping[str, StageRecord], opts: RunOptions) -> Health:
    """The run's health: each LLM stage's answered figure against ``min_answered``, and the
    signal check on the credit stage."""
    threshold = opts.min_answered
    out: dict[str, StageHealth] = {}
    messages = []
    for name, rec in stages.items():
        h = getattr(rec, "health", None)
        figure = stage_figure(h)
        if h is None or figure is None:
            continue
        ok = figure.share >= threshold
        out[name] = StageHealth(requests=figure.requests, answered=figure.answered,
                                answered_share=round(figure.share, 6), reasons=h["reasons"],
                                ok=ok)
        if not ok:
            why = "; ".join(f"{r} ×{n}" for r, n in
                            sorted(h["reasons"].items(), key=lambda kv: -kv[1])[:3])
            messages.append(f"{name}: {figure}, under --min-answered {threshold:.0%}"
                            + (f": {why}" if why else ""))
    signal = signal_check(stages, opts)
    if signal is not None and not signal["ok"]:
        messages.append(signal["problem"])
    return Health(ok=all(h.ok for h in out.values()) and (signal is None or signal["ok"]),
                  threshold=threshold, stages=out, messages=messages, signal=signal)


def credit_signal_problem(stats: Mapping[str, Any], reward: str, min_signal: float = 0.0
                          ) -> str | None:
    """Why a credit computation (its ``CreditStats`` as a mapping) gives the trainer no
    learning signal, or None (``inloop.metrics.signal_problem`` on its figures)."""
    from draco_cli.inloop.metrics import signal_problem

    n, nonzero = stats.get("rollouts", 0), stats.get("nonzero_advantages", 0)
    kept, dropped = stats.get("criteria_kept", 0), stats.get("criteria_dropped", 0)
    return signal_problem({"draco/rollouts": float(n),
                           "draco/nonzero_share": nonzero / n if n else 0.0,
                           "draco/criteria_total": float(kept + dropped) if reward == "rubric"
                           else 0.0,
                           "draco/criteria_kept": float(kept)}, min_signal)


def signal_check(stages: Mapping[str, StageRecord], opts: RunOptions) -> dict[str, Any] | None:
    """Whether the step gives the trainer a learning signal (from the credit stage)."""
    rec = stages.get("credit")
    stats = getattr(rec, "stats", None)
    if not stats:
        return None
    n, nonzero = stats.get("rollouts", 0), stats.get("nonzero_advantages", 0)
    problem = credit_signal_problem(stats, opts.credit.reward, opts.min_signal)
    allowed = opts.allow_no_signal
    return {"rollouts": n, "nonzero_advantages": nonzero,
            "nonzero_share": round(nonzero / n, 6) if n else 0.0,
            "min_signal": opts.min_signal,
            "ok": problem is None or allowed, "allowed": allowed and problem is not None,
            "problem": None if problem is None else
            problem + ("" if allowed else " (--allow-no-signal accepts such a step)")}
