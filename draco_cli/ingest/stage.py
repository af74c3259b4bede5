"""Ingest operation (``draco ingest``): agent logs in, the rollouts and steps tables and their
manifest published as one set.

The reading and writing stream entry by entry inside ``draco_cli.ingest`` (memory stays flat
as the logs grow), so this operation validates the options the command line spells as text and
hands over; it is the one entry point the CLI and Python users share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from draco_cli.errors import UsageError
from draco_cli.ingest import GROUP_FIELDS, IngestResult
from draco_cli.ingest import ingest as _ingest_logs
from draco_cli.ingest.codeblocks import DEFAULT_LANGUAGE


def parse_group_by(group_by: str | None) -> tuple[str, ...] | None:
    """``--group-by task_id,trial`` as a tuple of rollout fields (None: the default group)."""
    if not group_by:
        return None
    fields = tuple(g.strip() for g in group_by.split(","))
    for g in fields:
        if g not in GROUP_FIELDS:
            raise UsageError(f"--group-by {g!r}: choose among {', '.join(GROUP_FIELDS)}")
    return fields


def ingest_logs(fmt: str, inputs: list[str | Path], out: str | Path, *,
                step_unit: str = "message", tokenizer: str | None = None,
                group_by: str | tuple[str, ...] | None = None, train_step: int | None = None,
                skip_invalid: bool = False, force: bool = False,
                progress: Callable[[int], None] | None = None,
                code_language: str = DEFAULT_LANGUAGE, code_blocks: str = "one",
                ) -> IngestResult:
    """Ingest ``inputs`` (log files of format ``fmt``) into ``out``; see
    :func:`draco_cli.ingest.ingest` for the fields of the result."""
    if train_step is not None and train_step < 0:
        raise UsageError(f"--train-step {train_step}: must be ≥ 0")
    groups = parse_group_by(group_by) if isinstance(group_by, str) else group_by
    return _ingest_logs(fmt, [str(p) for p in inputs], out, step_unit=step_unit,
                        tokenizer=tokenizer, group_by=groups, train_step=train_step,
                        skip_invalid=skip_invalid, force=force, progress=progress,
                        code_language=code_language, code_blocks=code_blocks)
