"""Log ingestion: agent logs in, ``rollouts.parquet`` + ``steps.parquet`` + ``manifest.json`` out.

Input is streamed entry by entry and output written in batches, so memory stays flat as the
input grows. Each format module yields ``(where, Episode | InputError)``; this module decides
what to do with bad entries (stop, or ``skip_invalid``: record them in ``rejects.jsonl``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from draco_cli import __version__
from draco_cli.errors import InputError, UsageError
from draco_cli.ingest import openai_jsonl, tau2_bench, tau_bench
from draco_cli.ingest.episode import STEP_UNITS, BuildOptions, Episode, build
from draco_cli.ingest.tokens import make_counter
from draco_cli.io import OutputSet, StreamingTableWriter, check_writable
from draco_cli.schemas import SCHEMA_VERSION, Rollout, Step

Reader = Callable[[TextIO, str], Iterator[tuple[str, "Episode | InputError"]]]

FORMATS: dict[str, Reader] = {
    "openai-jsonl": openai_jsonl.iter_episodes,
    "tau-bench": tau_bench.iter_episodes,
    "tau2-bench": tau2_bench.iter_episodes,
}
GROUP_FIELDS = ("task_id", "train_step", "trial", "scenario_id", "difficulty")
BATCH_ROLLOUTS = 1000


@dataclass
class IngestResult:
    out_dir: Path
    rollouts: int = 0
    steps: int = 0
    rejected: int = 0
    groups: int = 0
    token_sources: Counter = field(default_factory=Counter)
    layout_unknown: int = 0
    terminations: Counter = field(default_factory=Counter)
    manifest: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def group_key(row: dict, group_by: tuple[str, ...]) -> str:
    return "/".join("" if row.get(k) is None else str(row[k]) for k in group_by)


def ingest(
    fmt: str,
    inputs: list[str | Path],
    out_dir: str | Path,
    *,
    step_unit: str = "message",
    tokenizer: str | None = None,
    group_by: tuple[str, ...] | None = None,
    train_step: int | None = None,
    skip_invalid: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> IngestResult:
    """Ingest ``inputs`` (files of format ``fmt``) into ``out_dir``.

    ``group_by`` overrides the group: the rollout fields whose values, joined by '/', form
    ``group_id``. By default an explicit group_id in the log is kept, otherwise the group is
    ``task_id`` (plus ``train_step`` when set).
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if step_unit not in STEP_UNITS:
        raise UsageError(f"unknown step unit {step_unit!r}; choose one of {', '.join(STEP_UNITS)}")
    for g in group_by or ():
        if g not in GROUP_FIELDS:
            raise UsageError(f"--group-by {g!r}: choose among {', '.join(GROUP_FIELDS)}")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise InputError("no such file", file=str(p))
    out = Path(out_dir)
    names = ["rollouts.parquet", "steps.parquet", "manifest.json"]
    for name in names:
        check_writable(out / name, force)
    counter = make_counter(tokenizer)
    opts_by_source = {str(p): BuildOptions(step_unit, counter, str(p)) for p in paths}  # type: ignore[arg-type]

    with OutputSet(out, names, force=force, replaceable=("rejects.jsonl",)) as output:
        return _ingest(fmt, paths, output, opts_by_source, counter, step_unit, group_by,
                       train_step, skip_invalid, progress)


def _ingest(fmt, paths, output: OutputSet, opts_by_source, counter, step_unit, group_by,
            train_step, skip_invalid, progress) -> IngestResult:
    out = output.folder
    result = IngestResult(out_dir=out)
    rollout_writer = StreamingTableWriter(output.path("rollouts.parquet"), Rollout, force=True,
                                          metadata=output.metadata)
    step_writer = StreamingTableWriter(output.path("steps.parquet"), Step, force=True,
                                       metadata=output.metadata)
    rejects: list[dict] = []
    seen_ids: dict[str, str] = {}
    groups: Counter = Counter()
    rollout_rows: list[dict] = []
    step_rows: list[dict] = []
    try:
        for path in paths:
            source = str(path)
            entries = 0
            with path.open("r", encoding="utf-8", errors="strict") as fp:
                try:
                    for where, item in FORMATS[fmt](fp, source):
                        entries += 1
                        try:
                            if isinstance(item, InputError):
                                raise item
                            if train_step is not None and item.train_step is None:
                                item.train_step = train_step
                            built = build(item, opts_by_source[source])
                            rid = built.rollout["rollout_id"]
                            if rid in seen_ids:
                                raise InputError(
                                    f"duplicate rollout_id {rid!r} (first at {seen_ids[rid]})",
                                    file=source, row=where, field="rollout_id",
                                )
                        except InputError as exc:
                            if not skip_invalid:
                                raise
                            rejects.append({"file": source, "entry": where, "reason": str(exc)})
                            result.rejected += 1
                            continue
                        seen_ids[rid] = f"{source} {where}"
                        row = built.rollout
                        if group_by:
                            row["group_id"] = group_key(row, group_by)
                        elif row["group_id"] is None:
                            keys = ("task_id", "train_step") if row["train_step"] is not None \
                                else ("task_id",)
                            row["group_id"] = group_key(row, keys)
                        groups[row["group_id"]] += 1
                        rollout_rows.append(row)
                        step_rows.extend(built.steps)
                        result.rollouts += 1
                        result.steps += len(built.steps)
                        result.token_sources[built.token_source] += 1
                        result.layout_unknown += not built.layout_known
                        result.terminations[row["termination"]] += 1
                        if len(rollout_rows) >= BATCH_ROLLOUTS:
                            rollout_writer.write_rows(rollout_rows)
                            step_writer.write_rows(step_rows)
                            rollout_rows, step_rows = [], []
                            if progress:
                                progress(result.rollouts)
                except UnicodeDecodeError as exc:
                    raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                                     file=source) from None
                except RecursionError:
                    raise InputError("JSON nested too deeply to be a log entry",
                                     file=source) from None
            if entries == 0:
                raise InputError(f"no rollouts in this file (empty {fmt} input)", file=source)
        if result.rollouts == 0:
            # Exit 0 with empty tables would look like success; say what happened instead.
            first = f" (first: {rejects[0]['reason']})" if rejects else ""
            raise InputError(f"all {result.rejected} entries were rejected, no rollout "
                             f"left to write{first}", file=", ".join(map(str, paths)))
        rollout_writer.write_rows(rollout_rows)
        step_writer.write_rows(step_rows)
        if progress:
            progress(result.rollouts)
        result.groups = len(groups)
        singles = sum(1 for n in groups.values() if n == 1)
        if singles == len(groups):
            result.warnings.append(
                f"every group has a single rollout ({len(groups)} groups): every group "
                "advantage will be 0. Ingest the trials of each task together, or choose the "
                f"grouping with --group-by (fields: {', '.join(GROUP_FIELDS)})")
        elif singles:
            result.warnings.append(f"{singles} of {len(groups)} groups have a single rollout: "
                                   "their group advantage will be 0")
        token_counts = sorted(k for k in result.token_sources if k != "none")
        result.manifest = {
            "draco_version": __version__,
            "schema_version": SCHEMA_VERSION,
            "format": fmt,
            "inputs": [{"path": str(p), "sha256": _sha256(p), "bytes": p.stat().st_size}
                       for p in paths],
            "step_unit": step_unit,
            "token_counts": token_counts,
            "tokenizer": None if counter is None else counter.name,
            "tokenizer_exact": None if counter is None else counter.exact,
            "token_positions": "known" if result.layout_unknown == 0 else
            f"unknown for {result.layout_unknown} rollout(s)",
            "group_by": list(group_by) if group_by else None,
            "train_step": train_step,
            "rollouts": result.rollouts,
            "steps": result.steps,
            "groups": result.groups,
            "single_rollout_groups": singles,
            "rejected": result.rejected,
            "terminations": {str(k): v for k, v in sorted(result.terminations.items(),
                                                          key=lambda kv: str(kv[0]))},
            "output_set": output.id,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
    except BaseException:
        rollout_writer.abort()
        step_writer.abort()
        raise
    rollout_writer.commit()
    step_writer.commit()
    if rejects or (out / "rejects.jsonl").exists():
        output.write_text("rejects.jsonl", "".join(json.dumps(r) + "\n" for r in rejects))
    output.write_text("manifest.json", json.dumps(result.manifest, indent=2) + "\n")
    return result
