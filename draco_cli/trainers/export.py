"""``draco export --to STACK``: a run's token advantages written in another RL stack's own
layout, for offline use (one module per stack, imported only when asked for).

Each stack module provides ``export(advantages, out, *, records=None, force=False) ->
ExportResult``: ``advantages`` is a run folder or a ``token_advantages.parquet``; ``records``
the stack's own rollout records to fill in, where the layout needs them. A stack's exported
file carries the same self-check columns as ``token_advantages.parquet`` (train step, number
of policy tokens, response fingerprint) wherever the stack's records let it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from draco_cli.errors import InputError, UsageError

# stack name -> module providing export()
STACKS: dict[str, str] = {
    "verifiers": "draco_cli.trainers.verifiers",
    "rllm": "draco_cli.trainers.rllm",
    "skyrl": "draco_cli.trainers.skyrl_export",
    "slime": "draco_cli.trainers.slime",
}


@dataclass
class ExportResult:
    path: Path
    rollouts: int
    tokens: int
    notes: list[str] = field(default_factory=list)


def advantages_file(advantages: Path) -> Path:
    """The token_advantages.parquet ``advantages`` names: the file, or a run folder's."""
    if advantages.is_dir():
        path = advantages / "credit" / "token_advantages.parquet"
        if not path.is_file():
            raise InputError("no credit/token_advantages.parquet in this run folder",
                             file=str(advantages))
        return path
    if not advantages.is_file():
        raise InputError("no such file", file=str(advantages))
    return advantages


def export_advantages(advantages: str | Path, to: str, out: str | Path, *,
                      records: str | Path | None = None, force: bool = False) -> ExportResult:
    """Write ``advantages`` (a run folder or token_advantages.parquet) for stack ``to``."""
    if to not in STACKS:
        raise UsageError(f"--to {to!r}: choose one of {', '.join(STACKS)}")
    module = importlib.import_module(STACKS[to])
    result: ExportResult = module.export(Path(advantages), Path(out),
                                         records=None if records is None else Path(records),
                                         force=force)
    return result
