"""``draco ingest verifiers traces.jsonl``: verifiers (0.4.0) episode records → draco's tables.
Records and the trace layout: see docs/trainers.md, "verifiers and prime-rl". Each trace with a
sampled token is a rollout (id ``trace.id``); group the episode's ``group.id`` (else the task
key, with the train step); train step ``run.work.step`` (else ``--train-step``); outcome the
trace's reward. A step's text is the message of the node that sampled it; its observation, the
messages after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from draco_cli.errors import InputError, UsageError
from draco_cli.inloop.rows import TrainerRollout, trainer_rows
from draco_cli.trainers.loader import AlignmentError
from draco_cli.trainers import field_of
from draco_cli.trainers.verifiers import (iter_records, message_text, record_step,
                                          task_id, trace_rollout, trace_tokens)


def _group(episode: dict[str, Any], trace: dict[str, Any], step: int | None) -> str:
    group = (episode.get("group") or {}).get("id")
    if group is not None:
        return str(group)
    return task_id(trace) if step is None else f"{task_id(trace)}/{step}"


def _texts(trace: dict[str, Any], steps: pl.DataFrame) -> pl.DataFrame:
    """Step texts from the trace's messages: the action the sampling node's message, the
    observation the messages of the nodes between this run and the next one."""
    tt = trace_tokens(trace)
    nodes = trace["nodes"]
    node_of = tt.node_of
    actions, observations = [], []
    starts = steps["token_start"].to_list()
    ends = [s + n for s, n in zip(starts, steps["n_tokens"].to_list())]
    for j, (s, e) in enumerate(zip(starts, ends)):
        oe = starts[j + 1] if j + 1 < len(starts) else len(node_of)
        acted = list(dict.fromkeys(node_of[s:e].tolist()))
        seen = list(dict.fromkeys(node_of[e:oe].tolist()))
        actions.append("\n".join(message_text(nodes[i].get("message")) for i in acted))
        observations.append("\n".join(message_text(nodes[i].get("message")) for i in seen
                                      if i not in acted and not nodes[i].get("sampled")))
    return steps.with_columns(pl.Series("action", actions, pl.String),
                              pl.Series("observation", observations, pl.String))


def ingest(paths: list[Path], out: Path, *, tokenizer: str | None = None,
           train_step: int | None = None, force: bool = False) -> Any:
    """Read ``paths`` (verifiers ``traces.jsonl`` files) into ``out`` (rollouts.parquet,
    steps.parquet, manifest.json): whole, or nothing on the first bad record."""
    from draco_cli.ingest import publish_records

    if tokenizer is not None:
        raise UsageError(f"--tokenizer {tokenizer!r}: verifiers records carry their token ids "
                         "and messages, the step texts come from the messages; leave it out")
    for p in paths:
        if not p.is_file():
            raise InputError("no such file", file=str(p))
    rows: list[pl.DataFrame] = []
    step_rows: list[pl.DataFrame] = []
    seen: dict[str, str] = {}
    skipped = 0
    errors = 0
    for p in paths:
        for n, episode in iter_records(p):
            step = record_step(episode)
            step = train_step if step is None else step
            for k, trace in enumerate(episode["traces"]):
                if not isinstance(trace, dict) or not isinstance(trace.get("nodes"), list):
                    raise InputError(f"trace {k}: no 'nodes' list", field="traces",
                                     file=str(p), row=n)
                tid = str(trace.get("id"))
                if not any(any(nd.get("mask") or []) for nd in trace["nodes"]):
                    skipped += 1   # nothing sampled: an eval relay or a prompt-only trace
                    continue
                if tid in seen:
                    raise InputError(f"duplicate trace id {tid!r} (first at {seen[tid]})",
                                     field="id", file=str(p), row=n)
                seen[tid] = f"{p} line {n}"
                try:
                    r: TrainerRollout = trace_rollout(trace, _group(episode, trace, step),
                                                      train_step=step)
                    ro, st = trainer_rows([r], lambda ids: "")
                except (AlignmentError, InputError) as exc:
                    raise InputError(str(exc), field="nodes", file=str(p), row=n) from None
                st = _texts(trace, st)
                bad = not field_of(trace, "ok", False)
                errors += bad
                ro = ro.with_columns(
                    pl.lit("env_error" if bad else None, pl.String).alias("termination"),
                    pl.lit(trace.get("stop_condition"), pl.String).alias("termination_raw"))
                rows.append(ro)
                step_rows.append(st)
    if not rows:
        raise InputError(f"no trace with a sampled token ({skipped} traces without one)",
                         file=", ".join(map(str, paths)))
    rollouts, steps = pl.concat(rows, how="diagonal_relaxed"), pl.concat(step_rows)
    result = publish_records("verifiers", paths, out, rollouts, steps, head={
        "step_unit": "policy-run", "token_positions": "known", "token_counts": ["token_ids"],
        "tokenizer": None, "tokenizer_exact": None, "group_by": None, "train_step": train_step,
    }, tail={"errored_traces": errors, "traces_without_sampled_tokens": skipped},
        force=force, created_first=True)
    result.token_sources["token_ids"] = rollouts.height
    if result.single_rollout_groups:
        result.warnings.append(f"{result.single_rollout_groups} of {result.groups} groups have "
                               "a single rollout: their group advantage will be 0")
    if skipped:
        result.warnings.append(f"{skipped} traces without a sampled token were left out")
    return result
