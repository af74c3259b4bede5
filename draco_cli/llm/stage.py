"""What the LLM operations (rubric generation, judge scoring) share: the inputs they read, the
prompt rendering options, the call log they resume from and the report they end with."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import polars as pl
import pyarrow.parquet as pq

from draco_cli.io import (STDIO, OutputSet, TableWriter, conform, folder_lock, prepare_out_dir,
                          read_table)
from draco_cli.llm.calllog import CallLog, reader
from draco_cli.llm.calllog_errors import retry_read
from draco_cli.llm.drive import Stage, drive
from draco_cli.llm.export import export_parquet
from draco_cli.llm.providers import REGISTRY, batches_by_default, parse_model_id
from draco_cli.redact import Redactor
from draco_cli.prompts.render import RenderOptions
from draco_cli.schemas import Rollout, Step, Table

if TYPE_CHECKING:
    from draco_cli.llm.client import LLMClient
    from draco_cli.llm.settings import LLMSettings
    from draco_cli.llm.types import PhaseStats
    from draco_cli.options import PromptOptions

R = TypeVar("R")

ROLLOUT_COLUMNS = ["rollout_id", "group_id", "task_id", "instruction", "task_context"]
STEP_COLUMNS = ["rollout_id", "step", "action", "observation"]


@dataclass
class StageReport:
    """What an LLM operation reports at its end (the command prints it)."""

    phases: dict[str, PhaseStats] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)
    budget_reached: bool = False
    rows: int = 0                 # rows of the stage's main output table


def read_inputs(rollouts: str | Path, steps: str | Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rollout and step columns a prompt is rendered from."""
    return (_read_text_table(rollouts, Rollout, ROLLOUT_COLUMNS),
            _read_text_table(steps, Step, STEP_COLUMNS))


def _read_text_table(path: str | Path, model: type[Table], columns: list[str]) -> pl.DataFrame:
    """``read_table`` with the same checks, for the columns holding the rollouts' text: a
    Parquet file is read by polars itself (through Arrow the text was held 2-3 times over while
    it was converted: +263 MiB at 100k rollouts of the benchmark, against +97); stdin, or a
    file polars cannot read as asked, goes through ``read_table`` and its errors."""
    wanted = list(dict.fromkeys([*model.keys, *columns]))
    if str(path) != STDIO and Path(path).is_file():
        try:
            # optional columns the file lacks (task_context of older tables) are added by conform
            names = set(pq.read_schema(path).names)
            df = pl.read_parquet(path, columns=[c for c in wanted if c in names])
        except Exception:   # noqa: BLE001 - read_table names what is wrong with the file
            pass
        else:
            return conform(df, model, str(path), wanted)
    return read_table(path, model, columns=columns)


def render_options(prompt: PromptOptions) -> RenderOptions:
    return RenderOptions(max_prompt_tokens=prompt.max_prompt_tokens,
                         redactor=Redactor(prompt.redact, defaults=not prompt.no_default_redact))


def finish(client: LLMClient, log_path: Path, out: Path, report: StageReport) -> None:
    """The client's phase statistics into ``report``, and the call log's Parquet export."""
    report.phases.update(client.stats)
    report.budget_reached = client.budget_reached
    export_parquet(log_path, out / "llm_calls.parquet", force=True)
    if not client.priced:
        report.notes.append(f"{client.model} is not in the price table: its cost shows as "
                            "unpriced (pass --prices FILE to price it)")


def log_position(log_path: Path) -> int:
    """The call log's last row id (0 when there is none yet): rows after it are this run's."""
    path = Path(log_path)
    if not path.exists():
        return 0
    conn = reader(path)

    def read() -> int:
        try:
            return int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM calls").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):   # a log without its table yet
                return 0
            raise

    try:
        return retry_read(path, read)
    finally:
        conn.close()


def unanswered_reasons(log_path: Path, phases: list[str], after: int) -> dict[str, int]:
    """Why samples of ``phases`` logged after row ``after`` stayed unanswered, counted per
    reason, read-only from the call log."""
    if not Path(log_path).exists() or not phases:
        return {}
    conn = reader(Path(log_path))
    try:
        rows = retry_read(Path(log_path), lambda: conn.execute(
            f"SELECT error, COUNT(*) FROM calls WHERE status = 'unanswered' AND phase IN "
            f"({','.join('?' * len(phases))}) AND rowid > ? GROUP BY error",
            (*phases, after)).fetchall())
    finally:
        conn.close()
    out: dict[str, int] = {}
    for error, n in rows:
        # one line, short: the reason names a kind of failure, not a whole server answer
        reason = (str(error or "no reason recorded").splitlines() or ["?"])[0][:120]
        out[reason] = out.get(reason, 0) + int(n)
    return out


def render_messages(messages: list[dict[str, Any]]) -> str:
    """A request's messages as text (``--show-prompt``)."""
    return "\n\n".join(f"===== {m['role']} =====\n{m['content']}" for m in messages)


# --- chunked stages: memory set by the chunk size, not by the number of rollouts ----------
#
# Rubrics and verdicts of a group depend on that group alone, so a stage runs over chunks of
# about CHUNK_ROLLOUTS rollouts: each chunk's requests are built, answered and turned into
# rows, and its rows are appended to the output tables in the staging folder of the stage's
# output set (published whole at the end, or not at all). CHUNKS_IN_FLIGHT chunks run at once
# on one client session, so the client's concurrency stays full while a chunk finishes its last
# calls (and, for rubrics, its merge phase). Outputs are written in chunk order, which is the
# order the whole-table stage wrote: the same tables, row for row.

CHUNK_ROLLOUTS = 1024
CHUNKS_IN_FLIGHT = 2


def batching(settings: LLMSettings) -> bool:
    """Whether the stage goes through the provider's batch API (then it is one batch, run
    whole as before: chunks would make many batches)."""
    if settings.batch is not None:
        return bool(settings.batch)
    return batches_by_default(settings.base_url, REGISTRY.get(parse_model_id(settings.model)[0]))


def chunk_frames(rollouts: pl.DataFrame, steps: pl.DataFrame, chunk: pl.Series
                 ) -> Iterator[tuple[pl.DataFrame, pl.DataFrame]]:
    """(rollouts, steps) of each chunk, in chunk order; ``chunk`` numbers each rollout row's
    chunk (0, 1, ... with none left empty). Rows keep their order within a chunk; steps of
    rollouts not listed are left out. Each chunk's rows are gathered when its turn comes (by
    positions found once), so the inputs are not copied whole."""
    n = int(chunk.max() or 0) + 1 if len(chunk) else 1   # type: ignore[arg-type]
    keyed = pl.DataFrame({"rollout_id": rollouts["rollout_id"], "__c": chunk})
    step_chunk = steps.select("rollout_id").join(keyed, on="rollout_id", how="left",
                                                 maintain_order="left")["__c"]
    del keyed
    r_at, r_counts = _positions(chunk, n)
    s_at, s_counts = _positions(step_chunk, n)
    del step_chunk
    contiguous = chunk.is_sorted()
    a = b = 0
    for k in range(n):
        r = rollouts.slice(a, r_counts[k]) if contiguous else \
            rollouts[r_at.slice(a, r_counts[k])]
        yield r, steps[s_at.slice(b, s_counts[k])]
        a += r_counts[k]
        b += s_counts[k]


def _positions(chunk: pl.Series, n: int) -> tuple[pl.Series, list[int]]:
    """Row positions ordered by chunk (stable; rows of no chunk last) and rows per chunk."""
    counts = [0] * n
    for k, c in chunk.drop_nulls().value_counts().iter_rows():
        counts[int(k)] = int(c)
    order = chunk.to_frame("c").select(
        pl.arg_sort_by("c", maintain_order=True, nulls_last=True)).to_series()
    return order, counts


class _ChunkProgress:
    """One progress count over every chunk and phase of a stage (the client counts each of its
    runs from zero); ``total`` is fixed up front, so a progress bar keeps one line."""

    def __init__(self, progress: Callable[[Any], None] | None, total: int) -> None:
        self.progress, self.total = progress, total
        self.done = self.failed = 0

    def sub(self) -> Callable[[Any], None] | None:
        if self.progress is None:
            return None
        last = [0, 0]

        def tick(p: Any) -> None:
            self.done += p.done - last[0]
            self.failed += p.failed - last[1]
            last[:] = [p.done, p.failed]
            assert self.progress is not None   # p: the client's Progress of this chunk
            self.progress(replace(p, done=self.done, total=self.total, failed=self.failed))

        return tick


async def _drive_chunk(stage: Stage[R], client: LLMClient, progress: _ChunkProgress) -> R:
    try:
        requests = next(stage)
        while True:
            requests = stage.send(await client.arun(requests, progress=progress.sub()))
    except StopIteration as stop:
        result: R = stop.value
        return result


def run_llm_stage(out: Path, models: dict[str, type[Table]], settings: LLMSettings,
                  call_log: Path | None, *, whole: Stage[R],
                  chunks: Callable[[], tuple[Iterable[Stage[R]], int]],
                  tables_of: Callable[[R], dict[str, pl.DataFrame]], force: bool,
                  progress: Callable[[Any], None] | None) -> StageReport:
    """An LLM operation's calls and outputs: either one batch for the whole stage (``whole``,
    as a batch API wants) or its chunks (``chunks``: their stages and the requests they make
    in all), the output set ``models`` names in ``out`` published from ``tables_of`` (a
    result's file name → rows), unless the budget was reached: then nothing is."""
    report = StageReport(outputs=[out / name for name in models])
    log_path = call_log if call_log is not None else out / "llm_calls.sqlite"
    # The folder stays locked through the calls: a second writer would pay for them again.
    with folder_lock(prepare_out_dir(out)), CallLog(log_path) as log:
        client = settings.client(log)
        if batching(settings):
            res = drive(whole, client, progress=progress, batch=settings.batch)
            finish(client, log_path, out, report)
            if not report.budget_reached:
                with OutputSet(out, list(models), force=force) as output:
                    for name, df in tables_of(res).items():
                        output.write_table(df, name, models[name])
        else:
            stages, total = chunks()
            # the set is published unless the budget was reached (``_Unpublished``)
            with contextlib.suppress(_Unpublished), \
                    OutputSet(out, list(models), force=force) as output:
                with TableWriter(output, models) as tables:

                    def write(result: R) -> None:
                        for name, df in tables_of(result).items():
                            tables.write(name, df)

                    asyncio.run(run_chunks(client, stages, write,
                                           _ChunkProgress(progress, total)))
                finish(client, log_path, out, report)
                if report.budget_reached:
                    raise _Unpublished()
    if report.budget_reached:
        report.notes.append("budget reached (--max-cost): tables not written; rerun to resume")
    return report


class _Unpublished(Exception):
    """Leaves an output set unpublished (the budget was reached)."""


async def run_chunks(client: LLMClient, stages: Iterable[Stage[R]], on_result: Callable[[R], None],
                     progress: _ChunkProgress) -> None:
    """Drive each chunk's stage on one client session, CHUNKS_IN_FLIGHT at a time, and hand
    the results to ``on_result`` in chunk order."""
    pending: deque[asyncio.Future[R]] = deque()
    async with client.session():
        try:
            for stage in stages:
                pending.append(asyncio.ensure_future(_drive_chunk(stage, client, progress)))
                if len(pending) >= CHUNKS_IN_FLIGHT:
                    on_result(await pending.popleft())
            while pending:
                on_result(await pending.popleft())
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
