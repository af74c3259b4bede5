"""``draco ingest skyrl FILE...``: SkyRL generator output (a ``GeneratorOutput`` as JSON, as
``draco_cli.trainers.skyrl_export.dump_records`` writes it) → ``rollouts`` + ``steps`` tables.
See docs/trainers.md, "SkyRL". SkyRL's own ``dump_data_batch`` pickles are not loaded: they run
code. Row id = ``TrajectoryID.to_string()``, group = its ``instance_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from draco_cli.errors import InputError, UsageError, naming
from draco_cli.inloop.rows import TrainerRollout, trainer_rows
from draco_cli.trainers.skyrl_rows import outcome_of, read_records, trajectory



def record_rollouts(rec: dict[str, Any], decode: Callable[[list[int]], str],
                    train_step: int | None, source: str) -> list[TrainerRollout]:
    step = train_step if train_step is not None else rec.get("global_step")
    out = []
    for i in range(len(rec["response_ids"])):
        with naming(source, i):
            rid, uid = trajectory(rec["trajectory_ids"][i])
        out.append(TrainerRollout(rid, uid, decode(list(rec["prompt_token_ids"][i])),
                                  rec["response_ids"][i], rec["loss_masks"][i],
                                  outcome=outcome_of(rec["rewards"][i]), task_id=uid,
                                  train_step=step, row=i))
    return out


def termination(stop_reason: Any) -> str | None:
    """SPEC termination of a SkyRL stop reason (vLLM's: "stop", "length"); None if unknown."""
    return {"stop": "submitted", "length": "max_length"}.get(str(stop_reason))


def _decoder(tokenizer: str | None) -> tuple[Callable[[list[int]], str], str]:
    if tokenizer is None:
        raise UsageError("draco ingest skyrl needs --tokenizer PATH (the trainer's "
                         "tokenizer.json): the records hold token ids, the judge reads text")
    from draco_cli.ingest.tokens import tokenizer_file_decode

    return tokenizer_file_decode(tokenizer, skip_special_tokens=True)


def ingest(paths: list[Path], out: Path, *, tokenizer: str | None, train_step: int | None,
           force: bool) -> Any:
    from draco_cli.ingest import publish_records

    decode, tok_name = _decoder(tokenizer)
    rollouts: list[TrainerRollout] = []
    ends: list[str | None] = []
    for p in paths:
        rec = read_records(p)
        rollouts += record_rollouts(rec, decode, train_step, str(p))
        ends += [termination(s) for s in (rec.get("stop_reasons") or [None] * len(rec["response_ids"]))]
    seen: set[str] = set()
    for r in rollouts:
        if r.rollout_id in seen:
            raise InputError(f"trajectory {r.rollout_id!r} appears twice (row ids must be "
                             "unique across the files)", field="trajectory_ids")
        seen.add(r.rollout_id)
    with naming(", ".join(map(str, paths))):
        rows, steps = trainer_rows(rollouts, decode)
    rows = rows.with_columns(pl.Series("termination", ends, dtype=pl.String))
    return publish_records("skyrl", paths, out, rows, steps, head={
        "step_unit": "policy-run", "token_counts": ["response_ids"], "tokenizer": tok_name,
        "tokenizer_exact": True, "token_positions": "known", "train_step": train_step},
        force=force)
