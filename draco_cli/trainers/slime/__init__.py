"""slime (THUDM/slime, not on the package index; read and run at commit 624b824a).

- ``advantages(args, rollout_data)``: slime's custom advantage function, on its command line
  as ``--custom-advantage-function-path draco_cli.trainers.slime.advantages`` (slime loads it
  with ``rpartition('.')``: a dotted path, not ``module:fn``), reading the rows of a run by
  ``Sample.index``, cut to the context-parallel rank (``hook``, ``layout``).
- ``score_rewards(args, samples)``: ``--custom-reward-post-process-path``, the rollout side of
  the in-loop route: judges the step's samples as they arrive and writes the step's tables
  for ``advantages`` to read (``inloop``).
- ``export(...)``: ``draco export --to slime`` (``offline``).

Nothing here imports torch, slime or Megatron until called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["advantages", "export", "score_rewards"]


def advantages(args: Any, rollout_data: dict[str, Any]) -> None:
    from draco_cli.trainers.slime.hook import advantages as run

    run(args, rollout_data)


def score_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    from draco_cli.trainers.slime.inloop import score_rewards as run

    return run(args, samples)


def export(advantages: Path, out: Path, *, records: Path | None = None,
           force: bool = False) -> Any:
    from draco_cli.trainers.slime.offline import export as run

    return run(advantages, out, records=records, force=force)
