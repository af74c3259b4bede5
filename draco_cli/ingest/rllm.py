"""``draco ingest rllm``: rLLM's saved episodes → rollouts.parquet + steps.parquet, one rollout
per trajectory, laid out as ``draco_cli.trainers.rllm.layout`` does. See docs/trainers.md, "rLLM".
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from draco_cli.errors import InputError, UsageError, naming
from draco_cli.ingest import (IngestResult, _group_warnings, publish_records)
from draco_cli.inloop.rows import TrainerRollout, trainer_rows
from draco_cli.trainers.rllm.layout import TrajectoryLayout, instruction_of, layout_of
from draco_cli.trainers.rllm.records import episode_files, read_episodes

# rLLM's TerminationReason values (rllm/workflows/workflow.py) → draco's terminations.
TERMINATIONS = {"env_done": "submitted", "max_turns_exceeded": "max_turns",
                "max_response_length_exceeded": "max_length",
                "max_prompt_length_exceeded": "max_length", "error": "env_error"}


def _decoder(tokenizer: str | None) -> Callable[[list[int]], str] | None:
    if tokenizer is None:
        return None
    path = Path(tokenizer)
    if not (path / "tokenizer.json" if path.is_dir() else path).is_file():
        raise UsageError(f"--tokenizer {tokenizer}: rllm records need a tokenizer.json (the "
                         "policy's) to decode their token ids, or none to use their texts")
    from draco_cli.ingest.tokens import tokenizer_file_decode

    return tokenizer_file_decode(tokenizer, skip_special_tokens=False)[0]


def _content(msg: Any) -> str:
    content = msg.get("content") if isinstance(msg, dict) else None
    return content if isinstance(content, str) else "" if content is None else json.dumps(content)


def _texts(steps: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(action, observation) per rLLM step from the records' own texts."""
    out = []
    for k, step in enumerate(steps):
        chat = step.get("chat_completions") or []
        action = step.get("model_response") or ""
        if not action and chat and isinstance(chat[-1], dict) and \
                chat[-1].get("role") == "assistant":
            action = _content(chat[-1])
        nxt = (steps[k + 1].get("chat_completions") or []) if k + 1 < len(steps) else []
        new = nxt[len(chat):] if nxt[:len(chat)] == chat else nxt
        obs = "\n".join(_content(m) for m in new
                        if isinstance(m, dict) and m.get("role") != "assistant")
        out.append((str(action), obs))
    return out


def _own_texts(steps_df: pl.DataFrame, layouts: dict[str, TrajectoryLayout],
               texts: dict[str, list[tuple[str, str]]]) -> pl.DataFrame:
    """Replace decoded texts with the records' texts: each draco step takes the rLLM steps
    whose tokens start inside it (two steps with no token between them are one run)."""
    actions, observations = [], []
    for rid, start, n in zip(steps_df["rollout_id"], steps_df["token_start"],
                             steps_df["n_tokens"]):
        inside = [k for k, (s, e) in enumerate(layouts[rid].spans)
                  if e > s and start <= s < start + n]
        actions.append("\n".join(texts[rid][k][0] for k in inside))
        observations.append(texts[rid][inside[-1]][1] if inside else "")
    return steps_df.with_columns(pl.Series("action", actions, pl.String),
                                 pl.Series("observation", observations, pl.String))


def ingest(paths: list[Path], out: Path, *, tokenizer: str | None = None,
           train_step: int | None = None, force: bool = False) -> IngestResult:
    """Ingest rLLM episode files (or folders of them) into ``out``."""
    decode = _decoder(tokenizer)
    files = episode_files(paths)
    rollouts: list[TrainerRollout] = []
    layouts: dict[str, TrajectoryLayout] = {}
    texts: dict[str, list[tuple[str, str]]] = {}
    extra: dict[str, dict[str, Any]] = {}
    seen: dict[str, str] = {}
    terminations: Counter[str | None] = Counter()
    for path, where, ep in read_episodes(files):
        eid = str(ep.get("id", ep.get("episode_id")))
        raw = ep.get("termination_reason")
        for t, traj in enumerate(ep["trajectories"]):
            row = f"{where} trajectory {t}"
            with naming(str(path), row):
                layout = layout_of(traj)
            rid = layout.rollout_id
            if rid in seen:
                raise InputError(f"duplicate trajectory uid {rid!r} (first at {seen[rid]})",
                                 file=str(path), row=row, field="uid")
            seen[rid] = f"{path} {row}"
            gid = f"{eid.split(':')[0]}:{traj.get('name') or 'default_traj_name'}"
            steps = traj["steps"]
            instruction = instruction_of(ep.get("task") or traj.get("task"),
                                         steps[0].get("chat_completions") or [])
            if not instruction and decode is not None:
                instruction = decode([int(i) for i in steps[0].get("prompt_ids") or []])
            reward = traj.get("reward")
            if reward is not None and not isinstance(reward, (int, float)):
                raise InputError(f"reward {reward!r} is not a number", file=str(path),
                                 row=row, field="reward")
            rollouts.append(layout.rollout(group_id=gid, instruction=instruction,
                                           outcome=None if reward is None else float(reward),
                                           task_id=eid.split(":")[0], train_step=train_step,
                                           row=len(rollouts)))
            layouts[rid], texts[rid] = layout, _texts(steps)
            extra[rid] = {"termination_raw": None if raw is None else str(raw),
                          "termination": TERMINATIONS.get(str(raw)) if raw else None,
                          "trial": _trial(eid)}
            terminations[extra[rid]["termination"]] += 1
    if not rollouts:
        raise InputError("no trajectories in these records", file=", ".join(map(str, paths)))
    with naming(", ".join(map(str, paths))):
        r_df, s_df = trainer_rows(rollouts, decode or (lambda ids: ""))
    if decode is None:
        s_df = _own_texts(s_df, layouts, texts)
    r_df = r_df.with_columns(
        pl.Series("termination", [extra[r]["termination"] for r in r_df["rollout_id"]],
                  pl.String),
        pl.Series("termination_raw", [extra[r]["termination_raw"] for r in r_df["rollout_id"]],
                  pl.String),
        pl.Series("trial", [extra[r]["trial"] for r in r_df["rollout_id"]], pl.Int32))
    result = publish_records("rllm", files, out, r_df, s_df, head={
        "step_unit": "message", "token_counts": ["rllm token ids"], "tokenizer": tokenizer,
        "tokenizer_exact": True, "token_positions": "known",
        "texts": "decoded with the tokenizer" if tokenizer else "the records' own texts",
        "group_by": ["task_id", "trajectory name"], "train_step": train_step,
    }, tail={"terminations": {str(k): v for k, v in sorted(terminations.items(),
                                                          key=lambda kv: str(kv[0]))}},
        force=force)
    result.token_sources["rllm token ids"] = r_df.height
    result.terminations = terminations
    result.warnings += _group_warnings(result.groups, result.single_rollout_groups)
    return result


def _trial(episode_id: str) -> int | None:
    tail = episode_id.split(":")[1] if ":" in episode_id else ""
    return int(tail) if tail.isdigit() else None
