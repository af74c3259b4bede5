"""``draco ingest slime DUMP.pt...``: slime's saved rollout samples → rollouts, steps, manifest.
See docs/trainers.md, "slime" ("From a rollout dump"). Records:
``draco_cli.trainers.slime.records``; rows: ``draco_cli.inloop.rows.trainer_rows``.
``--tokenizer`` is required: the step texts are the samples' token ids decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


from draco_cli.errors import InputError, UsageError
from draco_cli.ingest import IngestResult, publish_records


def tokenizer_decode(spec: str | None) -> Any:
    """``decode(ids) -> str`` of a tokenizer.json (a file or the folder holding it)."""
    if spec is None or spec == "approx":
        raise UsageError("--tokenizer PATH: slime samples hold token ids, and the model's "
                         "tokenizer.json turns each step's ids into the text the judge reads")
    from draco_cli.ingest.tokens import tokenizer_file_decode

    return tokenizer_file_decode(spec, skip_special_tokens=False)[0]


def ingest(paths: list[Path], out: Path, *, tokenizer: str | None, train_step: int | None,
           force: bool) -> IngestResult:
    from draco_cli.inloop.rows import trainer_rows
    from draco_cli.trainers.slime.records import dump_rollouts

    if not paths:
        raise UsageError("give at least one slime rollout dump (.pt)")
    decode = tokenizer_decode(tokenizer)
    rollouts: list[Any] = []
    removed, seen = 0, dict[str, str]()
    for path in paths:
        for i, r in dump_rollouts(path, decode=decode, train_step=train_step):
            if r is None:
                removed += 1
                continue
            if r.rollout_id in seen:
                raise InputError(f"sample index {r.rollout_id} again (first in {seen[r.rollout_id]})"
                                 ": draco keys rollouts by slime's Sample.index", file=str(path),
                                 row=i, field="index")
            seen[r.rollout_id] = f"{path}: sample {i}"
            rollouts.append(r)
    if not rollouts:
        raise InputError("no sample to ingest (every sample was removed)", file=str(paths[0]))
    rows, steps = trainer_rows(rollouts, decode)
    result = publish_records("slime", paths, out, rows, steps, head={
        "step_unit": "policy-run", "token_counts": ["tokenizer"], "tokenizer": tokenizer,
        "tokenizer_exact": True, "token_positions": "known", "group_by": ["group_index"],
        "train_step": train_step}, tail={"removed_samples": removed, "terminations": {}},
        force=force, created_first=True, indent=1)
    result.token_sources["tokenizer"] = rows.height
    if removed:
        result.warnings.append(f"{removed} sample(s) with remove_sample set left out (slime "
                               "trains on none of their tokens)")
    if result.single_rollout_groups:
        result.warnings.append(f"{result.single_rollout_groups} group(s) of one sample: "
                               "group-relative credit needs n_samples_per_prompt >= 2")
    return result
