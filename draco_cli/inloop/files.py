"""A scored step's tables on disk, for audit and ``draco report``: training itself never reads
them (the advantages travel with the rows). One folder per step, written whole or not at all
(a temporary folder renamed into place), the oldest beyond ``keep`` removed."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import polars as pl

from draco_cli import __version__
from draco_cli.errors import UsageError
from draco_cli.inloop.metrics import signal_problem
from draco_cli.inloop.step import StepResult
from draco_cli.io import conform
from draco_cli.schemas import Rollout, Step, Table

_STEP = re.compile(r"step-(\d+)$")
_LAYOUT = {"rubrics": "rubric", "verdicts_raw": "judge", "verdicts": "judge",
           "rewards": "credit", "step_credit": "credit", "token_advantages": "credit"}


def write_step(result: StepResult, root: str | os.PathLike[str], keep: int | None = None,
               add: bool = False) -> Path:
    """Write the step's tables under ``root/step-NNNNNN/`` (``draco run``'s layout: rubric/,
    judge/, credit/, the judged ``rollouts``/``steps``, ``metrics.json`` and a
    ``manifest.json`` that `draco report` and `draco sql` read); keep the newest ``keep``
    step folders. ``add``: ``result`` is another part of a step already written (a trainer
    that finishes one step's groups in several batches): its rows join the folder's, and the
    folder is healthy only while every part was."""
    if keep is not None and keep < 1:
        raise UsageError(f"keep {keep!r}: at least 1 step folder (None keeps all)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"step-{(result.train_step or 0):06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=root))
    try:
        for name, df in result.tables().items():
            if not df.width:
                continue
            (tmp / _LAYOUT[name]).mkdir(exist_ok=True)
            df.write_parquet(tmp / _LAYOUT[name] / f"{name}.parquet", compression="zstd")
        if result.spot_checks is not None and result.spot_checks.height:   # spot_check=N
            (tmp / "judge").mkdir(exist_ok=True)
            result.spot_checks.write_parquet(tmp / "judge" / "spot_checks.parquet",
                                             compression="zstd")
        # the rollouts and steps as judged (decoded from the trainer's tokens), so that
        # `draco report` and `draco sql` show the steps beside their credit
        judged = [g.inputs for g in result.groups if g.inputs is not None]
        contracts: tuple[tuple[str, type[Table]], ...] = (("rollouts", Rollout),
                                                          ("steps", Step))
        for i, (name, model) in enumerate(contracts):
            if judged:   # the whole contract: optional columns the trainer has not, as nulls
                conform(pl.concat([t[i] for t in judged], how="diagonal_relaxed"), model,
                        name).write_parquet(tmp / f"{name}.parquet", compression="zstd")
        summary = {"train_step": result.train_step, "metrics": result.metrics,
                   "fallbacks": result.fallbacks}
        # what `draco report` reads of a run folder: the step, and the signal check's verdict
        ok = result.metrics.get("draco/signal_ok", 1.0) == 1.0
        problem = (signal_problem(result.metrics) or "under the scorer's min_signal") \
            if not ok else None
        if add and (dest / "manifest.json").exists():
            problem = _join_parts(dest, tmp, summary) or problem
        (tmp / "metrics.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps({
            "kind": "draco in-loop step", "draco_version": __version__,
            "settings": result.settings, **summary,
            "health": {"ok": problem is None,
                       "messages": [problem] if problem else [],
                       "signal": {"problem": problem}}}, indent=1), encoding="utf-8")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                       if p.is_dir() and (m := _STEP.match(p.name)))
        for _, old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return dest


def _join_parts(dest: Path, tmp: Path, summary: dict[str, Any]) -> str | None:
    """The earlier parts of the step (in ``dest``) joined to this one (in ``tmp``): each table's
    rows, the fallbacks, the part count; returns the earlier parts' health problem, if any."""
    for old in dest.rglob("*.parquet"):
        new = tmp / old.relative_to(dest)
        new.parent.mkdir(parents=True, exist_ok=True)
        frames = [pl.read_parquet(old), *([pl.read_parquet(new)] if new.exists() else [])]
        pl.concat(frames, how="diagonal_relaxed").write_parquet(new, compression="zstd")
    before = json.loads((dest / "metrics.json").read_text(encoding="utf-8"))
    summary["fallbacks"] = {**before.get("fallbacks", {}), **summary["fallbacks"]}
    summary["parts"] = before.get("parts", 1) + 1
    health = json.loads((dest / "manifest.json").read_text(encoding="utf-8")).get("health", {})
    return None if health.get("ok", True) else (health.get("messages") or [None])[0]
