"""slime (read and run at commit 624b824a): ``advantages`` (``--custom-advantage-function-path``,
``hook``), ``score_rewards`` (``--custom-reward-post-process-path``, ``inloop``) and ``export``
(``draco export --to slime``, ``offline``). See docs/trainers.md, "slime". Nothing here imports
torch, slime or Megatron until called."""

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
