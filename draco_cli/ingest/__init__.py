"""Log ingestion: agent logs in, ``rollouts.parquet`` + ``steps.parquet`` + ``manifest.json`` out.

Input is streamed entry by entry and output written in batches, so memory stays flat as the
input grows. Each format module yields ``(where, Episode | InputError)``; this module decides
what to do with bad entries (stop, or ``skip_invalid``: record them in ``rejects.jsonl``).
"""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

from draco_cli import __version__
from draco_cli.errors import InputError, UsageError
from draco_cli.ingest import agentprocessbench, openai_jsonl, tau2_bench, tau_bench
from draco_cli.ingest.codeblocks import DEFAULT_LANGUAGE, CodeRule
from draco_cli.choices import STEP_UNITS, StepUnit
from draco_cli.ingest.episode import BuildOptions, Built, Episode, build
from draco_cli.ingest.tokens import TokenCounter, make_counter
from draco_cli.io import OutputSet, TableWriter, check_writable
from draco_cli.io.files import file_sha256
from draco_cli.schemas import SCHEMA_VERSION, Rollout, Step, StepLabel, Table

Reader = Callable[[TextIO, str], Iterator[tuple[str, "Episode | InputError"]]]

FORMATS: dict[str, Reader] = {
    "openai-jsonl": openai_jsonl.iter_episodes,
    "tau-bench": tau_bench.iter_episodes,
    "tau2-bench": tau2_bench.iter_episodes,
    "agentprocessbench": agentprocessbench.iter_episodes,
}
# Other RL stacks' rollout records, which carry token ids and masks: each module provides
# ``ingest(paths, out, *, tokenizer, train_step, force) -> IngestResult`` and takes positions
# from the ids (draco_cli.inloop.rows), so its advantages land on the stack's own tokens.
RECORD_FORMATS: dict[str, str] = {
    "verifiers": "draco_cli.ingest.verifiers",
    "rllm": "draco_cli.ingest.rllm",
    "skyrl": "draco_cli.ingest.skyrl",
    "slime": "draco_cli.ingest.slime",
}
# Formats whose entries carry step labels: they write step_labels.parquet too, and their
# labels key whole messages, so a step is a message.
LABELLED_FORMATS = ("agentprocessbench",)
GROUP_FIELDS = ("task_id", "train_step", "trial", "scenario_id", "difficulty")
BATCH_ROLLOUTS = 1000


@dataclass
class IngestResult:
    out_dir: Path
    rollouts: int = 0
    steps: int = 0
    labels: int = 0
    rejected: int = 0
    groups: int = 0
    single_rollout_groups: int = 0
    token_sources: Counter[str] = field(default_factory=Counter)
    layout_unknown: int = 0
    terminations: Counter[str | None] = field(default_factory=Counter)
    skipped_blocks: Counter[str] = field(default_factory=Counter)  # code-block: did not run
    manifest: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def group_key(row: dict[str, Any], group_by: tuple[str, ...]) -> str:
    return "/".join("" if row.get(k) is None else str(row[k]) for k in group_by)


def ingest(
    fmt: str,
    inputs: list[str | Path],
    out: str | Path,
    *,
    step_unit: str = "message",
    tokenizer: str | None = None,
    group_by: str | tuple[str, ...] | None = None,
    train_step: int | None = None,
    skip_invalid: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    code_language: str = DEFAULT_LANGUAGE,
    code_blocks: str = "one",
) -> IngestResult:
    """Ingest ``inputs`` (files of format ``fmt``) into the folder ``out``.

    ``group_by`` overrides the group: the rollout fields (a tuple, or comma-separated as
    ``--group-by`` spells them) whose values, joined by '/', form ``group_id``. By default an
    explicit group_id in the log is kept, otherwise the group is ``task_id`` (plus
    ``train_step`` when set).

    Under the ``code-block`` unit a step is a fenced block the harness ran: one in
    ``code_language`` (comma-separated languages, or 'any'; default mini-swe-agent's bash),
    and under ``code_blocks='one'`` only in a message holding exactly one such block
    (``draco_cli.ingest.codeblocks``).
    """
    group_by = _group_fields(group_by, train_step)
    if fmt in RECORD_FORMATS:
        import importlib

        result: IngestResult = importlib.import_module(RECORD_FORMATS[fmt]).ingest(
            [Path(p) for p in inputs], Path(out), tokenizer=tokenizer,
            train_step=train_step, force=force)
        return result
    _check_options(fmt, step_unit)
    labelled, tokenizer = _labelled_format(fmt, step_unit, tokenizer)
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise InputError("no such file", file=str(p))
    out = Path(out)
    models: dict[str, type[Table]] = {"rollouts.parquet": Rollout, "steps.parquet": Step,
                                      **({"step_labels.parquet": StepLabel} if labelled else {})}
    names = [*models, "manifest.json"]
    for name in names:
        check_writable(out / name, force)
    code = CodeRule.parse(code_language, code_blocks)
    counter = make_counter(tokenizer)
    unit = cast(StepUnit, step_unit)  # checked against STEP_UNITS above
    opts_by_source = {str(p): BuildOptions(unit, counter, str(p), code) for p in paths}

    with (OutputSet(out, names, force=force, replaceable=("rejects.jsonl",)) as output,
          TableWriter(output, models) as tables):
        run = _Ingestion(tables, opts_by_source, group_by, train_step, skip_invalid, progress)
        for path in paths:
            run.read_file(fmt, path)
        result = run.finish(paths)
        if unit == "code-block":
            _check_code_blocks(result, code, paths)
        result.manifest = _manifest(result, fmt, paths, step_unit, counter, group_by,
                                    train_step, output.id)
        if unit == "code-block":
            result.manifest["code_language"] = code.describe()
            result.manifest["code_blocks"] = code.blocks
            result.manifest["code_blocks_not_run"] = dict(sorted(result.skipped_blocks.items()))
        if run.rejects or (out / "rejects.jsonl").exists():
            output.write_text("rejects.jsonl", "".join(json.dumps(r) + "\n" for r in run.rejects))
        output.write_text("manifest.json", json.dumps(result.manifest, indent=2) + "\n")
        return result


def _group_fields(group_by: str | tuple[str, ...] | None, train_step: int | None
                  ) -> tuple[str, ...] | None:
    if train_step is not None and train_step < 0:
        raise UsageError(f"--train-step {train_step}: must be ≥ 0")
    if isinstance(group_by, str):
        group_by = tuple(g.strip() for g in group_by.split(",")) if group_by else None
    for g in group_by or ():
        if g not in GROUP_FIELDS:
            raise UsageError(f"--group-by {g!r}: choose among {', '.join(GROUP_FIELDS)}")
    return group_by


def _check_options(fmt: str, step_unit: str) -> None:
    if fmt not in FORMATS:
        names = [*FORMATS, *RECORD_FORMATS]
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(names)}")
    if step_unit not in STEP_UNITS:
        raise UsageError(f"unknown step unit {step_unit!r}; choose one of {', '.join(STEP_UNITS)}")


def _labelled_format(fmt: str, step_unit: str, tokenizer: str | None
                     ) -> tuple[bool, str | None]:
    """(whether ``fmt`` carries step labels, the tokenizer to count with)."""
    if fmt not in LABELLED_FORMATS:
        return False, tokenizer
    if step_unit != "message":
        raise UsageError(f"--step-unit {step_unit}: {fmt} labels whole assistant messages, so "
                         "its step unit is message")
    # The benchmark logs no token counts; its step labels need no exact count.
    return True, tokenizer or "approx"


class _Ingestion:
    """One ingest in progress: the rows built so far, written in batches, and the counts."""

    def __init__(self, tables: TableWriter, opts_by_source: dict[str, BuildOptions],
                 group_by: tuple[str, ...] | None, train_step: int | None,
                 skip_invalid: bool, progress: Callable[[int], None] | None) -> None:
        self.tables = tables
        self.opts_by_source = opts_by_source
        self.group_by = group_by
        self.train_step = train_step
        self.skip_invalid = skip_invalid
        self.progress = progress
        self.result = IngestResult(out_dir=tables.output.folder)
        self.label_rows: list[dict[str, Any]] = []
        self.rejects: list[dict[str, str]] = []
        self.seen_ids: dict[str, str] = {}  # rollout_id -> where it was first seen
        self.groups: Counter[str] = Counter()
        self.rollout_rows: list[dict[str, Any]] = []
        self.step_rows: list[dict[str, Any]] = []

    def read_file(self, fmt: str, path: Path) -> None:
        source = str(path)
        entries = 0
        with path.open("r", encoding="utf-8", errors="strict") as fp:
            try:
                for where, item in FORMATS[fmt](fp, source):
                    entries += 1
                    self._entry(source, where, item)
            except UnicodeDecodeError as exc:
                raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                                 file=source) from None
            except RecursionError:
                raise InputError("JSON nested too deeply to be a log entry",
                                 file=source) from None
        if entries == 0:
            raise InputError(f"no rollouts in this file (empty {fmt} input)", file=source)

    def _build(self, source: str, where: str, item: Episode | InputError) -> Built:
        if isinstance(item, InputError):
            raise item
        if self.train_step is not None and item.train_step is None:
            item.train_step = self.train_step
        built = build(item, self.opts_by_source[source])
        rid = built.rollout["rollout_id"]
        if rid in self.seen_ids:
            raise InputError(f"duplicate rollout_id {rid!r} (first at {self.seen_ids[rid]})",
                             file=source, row=where, field="rollout_id")
        return built

    def _entry(self, source: str, where: str, item: Episode | InputError) -> None:
        try:
            built = self._build(source, where, item)
        except InputError as exc:
            if not self.skip_invalid:
                raise
            self.rejects.append({"file": source, "entry": where, "reason": str(exc)})
            self.result.rejected += 1
            return
        row = built.rollout
        self.seen_ids[row["rollout_id"]] = f"{source} {where}"
        if self.group_by:
            row["group_id"] = group_key(row, self.group_by)
        elif row["group_id"] is None:
            keys = ("task_id", "train_step") if row["train_step"] is not None else ("task_id",)
            row["group_id"] = group_key(row, keys)
        self.groups[row["group_id"]] += 1
        self.rollout_rows.append(row)
        self.step_rows.extend(built.steps)
        self.label_rows.extend(built.labels)
        result = self.result
        result.rollouts += 1
        result.steps += len(built.steps)
        result.labels += len(built.labels)
        result.token_sources[built.token_source] += 1
        result.layout_unknown += not built.layout_known
        result.terminations[row["termination"]] += 1
        result.skipped_blocks.update(built.skipped_blocks)
        if len(self.rollout_rows) >= BATCH_ROLLOUTS:
            self._flush()

    def _flush(self) -> None:
        self.tables.write_rows("rollouts.parquet", self.rollout_rows)
        self.tables.write_rows("steps.parquet", self.step_rows)
        if "step_labels.parquet" in self.tables.models:
            self.tables.write_rows("step_labels.parquet", self.label_rows)
        self.rollout_rows, self.step_rows, self.label_rows = [], [], []
        if self.progress:
            self.progress(self.result.rollouts)

    def finish(self, paths: list[Path]) -> IngestResult:
        """Write the last batch; the result with its group counts and warnings."""
        result = self.result
        if result.rollouts == 0:
            # Exit 0 with empty tables would look like success; say what happened instead.
            first = f" (first: {self.rejects[0]['reason']})" if self.rejects else ""
            raise InputError(f"all {result.rejected} entries were rejected, no rollout "
                             f"left to write{first}", file=", ".join(map(str, paths)))
        self._flush()
        result.groups = len(self.groups)
        result.single_rollout_groups = sum(1 for n in self.groups.values() if n == 1)
        result.warnings += _group_warnings(result.groups, result.single_rollout_groups)
        return result


def _check_code_blocks(result: IngestResult, code: CodeRule, paths: list[Path]) -> None:
    """No block ran anywhere while blocks of other languages were written: the language is
    almost surely wrong, and every rollout would be a silent no_action."""
    if result.steps or not result.skipped_blocks:
        return
    seen = ", ".join(f"{lang or 'no language'}: {n}"
                     for lang, n in result.skipped_blocks.most_common(5))
    hint = "pass --code-language with the language your harness runs (or 'any')"
    if code.blocks == "one":
        hint += ", or --code-blocks all if it runs every block of a message"
    raise InputError(f"no fenced {code.describe()} block ran in any rollout (--code-language "
                     f"{code.describe()}, --code-blocks {code.blocks}), yet the agent wrote "
                     f"{sum(result.skipped_blocks.values())} other fenced blocks ({seen}); "
                     f"{hint}", file=", ".join(map(str, paths)))


def _group_warnings(groups: int, singles: int) -> list[str]:
    if singles == groups:
        return [f"every group has a single rollout ({groups} groups): every group "
                "advantage will be 0. Ingest the trials of each task together, or choose the "
                f"grouping with --group-by (fields: {', '.join(GROUP_FIELDS)})"]
    if singles:
        return [f"{singles} of {groups} groups have a single rollout: "
                "their group advantage will be 0"]
    return []


def manifest_head(fmt: str, paths: list[Path]) -> dict[str, Any]:
    """The keys every ingest manifest opens with: versions, format, and each input's hash."""
    return {"draco_version": __version__, "schema_version": SCHEMA_VERSION, "format": fmt,
            "inputs": [{"path": str(p), "sha256": file_sha256(p), "bytes": p.stat().st_size}
                       for p in paths]}


def created_at() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def publish_records(fmt: str, paths: list[Path], out: Path, rollouts: Any, steps: Any, *,
                    head: dict[str, Any], tail: dict[str, Any] | None = None, force: bool,
                    created_first: bool = False, indent: int = 2) -> IngestResult:
    """A record format's tables and manifest, published as one output set. The manifest is
    ``manifest_head``, ``head`` (the format's fields), the counts, ``tail``, and the output
    set's stamps; each format keeps the key order its manifests always had."""
    sizes = rollouts.group_by("group_id").len()
    result = IngestResult(out_dir=out, rollouts=rollouts.height, steps=steps.height,
                          groups=sizes.height,
                          single_rollout_groups=int((sizes["len"] == 1).sum()))
    with OutputSet(out, ["rollouts.parquet", "steps.parquet", "manifest.json"],
                   force=force) as output:
        output.write_table(rollouts, "rollouts.parquet", Rollout)
        output.write_table(steps, "steps.parquet", Step)
        stamps = [("output_set", output.id), ("created_at", created_at())]
        result.manifest = {
            **manifest_head(fmt, paths), **head, "rollouts": result.rollouts,
            "steps": result.steps, "groups": result.groups,
            "single_rollout_groups": result.single_rollout_groups, "rejected": 0,
            **(tail or {}), **dict(stamps[::-1] if created_first else stamps)}
        output.write_text("manifest.json", json.dumps(result.manifest, indent=indent) + "\n")
    return result


def _manifest(result: IngestResult, fmt: str, paths: list[Path], step_unit: str,
              counter: TokenCounter | None, group_by: tuple[str, ...] | None,
              train_step: int | None, output_set: str) -> dict[str, Any]:
    return {
        **manifest_head(fmt, paths),
        "step_unit": step_unit,
        "token_counts": sorted(k for k in result.token_sources if k != "none"),
        "tokenizer": None if counter is None else counter.name,
        "tokenizer_exact": None if counter is None else counter.exact,
        "token_positions": "known" if result.layout_unknown == 0 else
        f"unknown for {result.layout_unknown} rollout(s)",
        "group_by": list(group_by) if group_by else None,
        "train_step": train_step,
        "rollouts": result.rollouts,
        "steps": result.steps,
        **({"step_labels": result.labels} if fmt in LABELLED_FORMATS else {}),
        "groups": result.groups,
        "single_rollout_groups": result.single_rollout_groups,
        "rejected": result.rejected,
        "terminations": {str(k): v for k, v in sorted(result.terminations.items(),
                                                      key=lambda kv: str(kv[0]))},
        "output_set": output_set,
        "created_at": created_at(),
    }


# the name Python users know from ``draco_cli``
ingest_logs = ingest
