"""``draco run --engine ray``: the LLM stages (rubric, judge) on a Ray cluster's workers, one
partition of groups per map task, each with its own call log under ``RUN/ray/part-K/``. See
docs/run.md, "--engine ray". Credit runs on the driver: it is per-group arithmetic, seconds for
millions of rows.
"""

from __future__ import annotations

import hashlib
import pickle
import sqlite3
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import polars as pl
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from draco_cli.errors import DracoError, UsageError

if TYPE_CHECKING:
    from draco_cli.llm.stage import StageReport

PART = "__draco_partition"


def _ray() -> Any:   # the ray module: untyped (no stubs), Any is its boundary
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise UsageError("--engine ray needs Ray: pip install 'ray[data]==2.55.0' (the 'ray' "
                         "extra)") from None
    return ray


def connect(address: str | None) -> None:
    """Join the cluster at ``address`` (None: a local one, or the one already joined)."""
    ray = _ray()
    if ray.is_initialized():
        return
    if address and address not in ("auto", "local") and "://" not in address:
        _probe(address)   # Ray itself retries an unreachable address for minutes
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError, SystemExit) as exc:
        first = (str(exc).strip().splitlines() or ["?"])[0][:200]
        raise UsageError(f"--ray-address {address}: cannot reach the Ray cluster ({first})"
                         ) from None


def _probe(address: str, timeout: float = 5.0) -> None:
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return
    except ValueError:
        raise UsageError(f"--ray-address {address}: expected HOST:PORT") from None
    except OSError as exc:
        raise UsageError(f"--ray-address {address}: cannot reach the Ray cluster "
                         f"({exc.strerror or exc})") from None


def partition_of(group_id: str, partitions: int) -> int:
    return int(hashlib.sha256(group_id.encode()).hexdigest()[:8], 16) % partitions


def run_partitions(stage: str, rollouts: Path, steps: Path, run_dir: Path,
                   work: partial[StageReport], *, partitions: int | None, address: str | None,
                   main_log: Path) -> list[tuple[int, StageReport]]:
    """Run ``work(part_rollouts, part_steps, out=part_dir, call_log=part_log)`` (a partial of
    the stage's function) for each partition on the cluster; return the partitions' reports
    in partition order.
    ``partitions`` None: as many as the cluster has CPUs (why: docs/run.md, "Partitions")."""
    ray = _ray()
    connect(address)
    partitions = partitions or cluster_cpus()
    from draco_cli.io import as_frame, read_arrow

    table = read_arrow(rollouts)
    # ids are non-null strings (the Rollout contract ingest wrote); the stubs say Any | None
    gids = cast("list[str]", table.column("group_id").to_pylist())
    part_of = [partition_of(g, partitions) for g in gids]
    table = table.append_column(PART, pa.array(part_of, pa.int32()))
    root = Path(run_dir).absolute() / "ray"
    steps = Path(steps).absolute()
    if "rubrics" in work.keywords:
        work = partial(work, rubrics=Path(work.keywords["rubrics"]).absolute())
    present = sorted(set(part_of))
    seed_partition_logs(main_log, run_dir, table)
    work = share_limits(work, min(len(present), cluster_cpus()))
    # The dataset's blocks are the partitions, split on the driver, each one map task (not
    # a Ray Data groupby: docs/run.md, "Partitions").
    blocks = [table.filter(pa.compute.equal(table.column(PART), pa.scalar(part, pa.int32())))
              for part in present]
    rows_of = {part: b.num_rows for part, b in zip(present, blocks)}

    def one(batch: pa.Table) -> pa.Table:
        part = batch.column(PART)[0].as_py()
        # a batch must be a whole partition (batch_size=None maps one block as one batch; a
        # block Ray had split would make two tasks write one partition's folder)
        if batch.num_rows != rows_of[part]:
            raise DracoError(f"--engine ray: partition {part} arrived as {batch.num_rows} of "
                             f"its {rows_of[part]} rows (Ray split its block)")
        d = root / f"part-{part}"
        d.mkdir(parents=True, exist_ok=True)
        r = as_frame(batch.drop_columns([PART]))
        r.write_parquet(d / f"{stage}-rollouts.parquet")
        s = pl.read_parquet(steps).filter(pl.col("rollout_id").is_in(r["rollout_id"].implode()))
        s.write_parquet(d / f"{stage}-steps.parquet")
        report = work(d / f"{stage}-rollouts.parquet", d / f"{stage}-steps.parquet",
                      out=d / stage, call_log=d / "llm_calls.sqlite")
        return pa.table({"part": [part], "report": [pickle.dumps(report)]})

    ds = ray.data.from_arrow(blocks).map_batches(one, batch_size=None, batch_format="pyarrow")
    try:
        rows = ds.take_all()
    except DracoError:
        raise
    except Exception as exc:  # a task that failed past Ray's retries
        cause: BaseException = exc
        # Ray's task errors chain the worker's exception as ``.cause``
        while getattr(cause, "cause", None) is not None:
            cause = getattr(cause, "cause")  # noqa: B009 - not an attribute of BaseException to mypy
        if isinstance(cause, DracoError):
            raise cause from None
        first = (str(cause).strip().splitlines() or ["?"])[0][:300]
        raise DracoError(f"--engine ray: a partition failed ({first}); rerun to resume from "
                         "its call log") from None
    rows.sort(key=lambda row: row["part"])
    return [(row["part"], pickle.loads(row["report"])) for row in rows]


def cluster_cpus() -> int:
    """CPUs of the cluster joined: how many partitions run at once."""
    ray = _ray()
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def share_limits(work: partial[StageReport], slots: int) -> partial[StageReport]:
    """``work`` with its LLM settings' limits shared among the ``slots`` partitions that run
    at once (docs/run.md, "Limits are the run's, not each partition's")."""
    from dataclasses import replace

    llm = work.keywords["settings"]
    shared = replace(llm, concurrency=max(1, -(-llm.concurrency // slots)),
                     rpm=llm.rpm and llm.rpm / slots, tpm=llm.tpm and llm.tpm / slots,
                     max_cost=llm.max_cost and llm.max_cost / slots)
    return partial(work, settings=shared)


def seed_partition_logs(main_log: Path, run_dir: Path, table: pa.Table) -> None:
    """Copy into each partition's call log the answered calls of the run's log for the
    partition's rollouts and groups (the call log's ``key``): docs/run.md, "Nothing is paid
    twice". The copied rows are marked as merged, so they do not come back into the run's log."""
    from draco_cli.llm.calllog import COLUMNS, CallLog

    if not Path(main_log).exists():
        return
    merge_call_logs(run_dir, main_log)   # first, whatever a partition answered and did not merge
    root = Path(run_dir) / "ray"
    parts = cast("list[int]", table.column(PART).to_pylist())
    keys: dict[int, set[str]] = {}
    for col in ("group_id", "rollout_id"):
        ids = cast("list[str]", table.column(col).to_pylist())
        for part, k in zip(parts, ids):
            keys.setdefault(part, set()).add(k)
    main = sqlite3.connect(main_log)
    try:
        for part, ks in sorted(keys.items()):
            d = root / f"part-{part}"
            d.mkdir(parents=True, exist_ok=True)
            log = d / "llm_calls.sqlite"
            with CallLog(log):   # creates / migrates the partition's log
                pass
            con = sqlite3.connect(log)
            try:
                con.execute("ATTACH DATABASE ? AS m", (str(main_log),))
                con.execute("CREATE TEMP TABLE wanted (k TEXT PRIMARY KEY)")
                con.executemany("INSERT OR IGNORE INTO wanted VALUES (?)", [(k,) for k in ks])
                cols = ", ".join(COLUMNS)
                con.execute(
                    f"INSERT INTO main.calls ({cols}) SELECT {cols} FROM m.calls AS r "
                    "WHERE r.status = 'ok' AND r.key IN (SELECT k FROM temp.wanted) AND NOT "
                    "EXISTS (SELECT 1 FROM main.calls AS c WHERE c.request_hash = "
                    "r.request_hash AND c.sample IS r.sample AND c.status = 'ok')")
                con.commit()
                top = con.execute("SELECT MAX(id) FROM main.calls").fetchone()[0] or 0
                con.execute("DETACH DATABASE m")
            finally:
                con.close()
            main.execute("INSERT OR REPLACE INTO ray_merged VALUES (?, ?)", (d.name, top))
        main.commit()
    finally:
        main.close()


def merge_reports(parts: list[tuple[int, StageReport]]) -> StageReport:
    """One StageReport from the partitions' (phases summed, notes kept once each)."""
    from draco_cli.llm.types import PhaseStats
    from draco_cli.llm.stage import StageReport

    out = StageReport()
    for _, rep in parts:
        for phase, st in rep.phases.items():
            acc = out.phases.setdefault(phase, PhaseStats())
            for f in fields(PhaseStats):
                if f.name == "priced":
                    acc.priced = acc.priced and st.priced
                else:
                    setattr(acc, f.name, getattr(acc, f.name) + getattr(st, f.name))
        out.budget_reached = out.budget_reached or rep.budget_reached
        out.rows += rep.rows
    out.notes = [f"--engine ray: {len(parts)} partitions"]
    return out


def merge_call_logs(run_dir: Path, main_log: Path) -> None:
    """Copy the partitions' call-log rows the run's log does not hold yet into it (a
    partition's rows are copied once: the highest id copied is remembered per partition)."""
    from draco_cli.llm.calllog import COLUMNS, CallLog, read_only

    with CallLog(main_log):   # creates / migrates the main log
        pass
    root = Path(run_dir) / "ray"
    con = sqlite3.connect(main_log)
    try:
        con.execute("CREATE TABLE IF NOT EXISTS ray_merged (part TEXT PRIMARY KEY, "
                    "last_id INTEGER)")
        for log in sorted(root.glob("part-*/llm_calls.sqlite")):
            key = str(log.parent.name)
            last = (con.execute("SELECT last_id FROM ray_merged WHERE part = ?", (key,))
                    .fetchone() or [0])[0]
            with read_only(log) as (src, have):
                cols = [c for c in COLUMNS if c in have]
                rows = src.execute(f"SELECT id, {', '.join(cols)} FROM calls WHERE id > ? "
                                   "ORDER BY id", (last,)).fetchall()
            if rows:
                con.executemany(f"INSERT INTO calls ({', '.join(cols)}) VALUES "
                                f"({', '.join('?' * len(cols))})", [r[1:] for r in rows])
                con.execute("INSERT OR REPLACE INTO ray_merged VALUES (?, ?)",
                            (key, rows[-1][0]))
        con.commit()
    finally:
        con.close()


def in_input_order(df: pl.DataFrame, key: str, order: list[str]) -> pl.DataFrame:
    """Rows in the order the local engine writes them: by ``key``'s first appearance in the
    input, the partition's own order kept within a key."""
    rank = pl.DataFrame({key: order, "__rank": range(len(order))}, schema={
        key: pl.String, "__rank": pl.Int64})
    return df.join(rank, on=key, how="left", maintain_order="left").sort(
        "__rank", maintain_order=True).drop("__rank")


def run_stage(stage: str, rollouts: Path, steps: Path, run_dir: Path, main_log: Path,
              work: partial[StageReport], *, partitions: int | None, address: str | None
              ) -> StageReport:
    """One LLM stage on the cluster, its union written into ``run_dir/<stage>``; returns the
    merged StageReport (``outputs`` in the run folder)."""
    from draco_cli.io import OutputSet, read_arrow
    from draco_cli.llm.export import export_parquet
    from draco_cli.schemas import TABLES

    parts = run_partitions(stage, rollouts, steps, run_dir, work, partitions=partitions,
                           address=address, main_log=main_log)
    merge_call_logs(run_dir, main_log)
    report = merge_reports(parts)
    out = Path(run_dir) / stage
    names = {"rubric": ["rubric_candidates.parquet", "rubrics.parquet"],
             "judge": ["verdicts_raw.parquet", "verdicts.parquet"]}[stage]
    key = "group_id" if stage == "rubric" else "rollout_id"
    order = list(dict.fromkeys(cast("list[str]",
                                    read_arrow(rollouts, [key]).column(key).to_pylist())))
    report.outputs = [out / n for n in names]
    out.mkdir(parents=True, exist_ok=True)
    export_parquet(main_log, out / "llm_calls.parquet", force=True)
    if report.budget_reached:
        report.notes.append("budget reached (--max-cost): tables not written; rerun to resume")
        return report
    with OutputSet(out, names, force=True) as output:
        for name in names:   # the partitions' tables, concatenated in partition order
            frames = [pl.read_parquet(p) for p in
                      (rep.outputs[0].parent / name for _, rep in parts) if p.exists()]
            if not frames:
                raise DracoError(f"--engine ray: no partition wrote {stage}/{name}")
            output.write_table(in_input_order(pl.concat(frames, how="vertical_relaxed"), key,
                                              order), name, TABLES[name.removesuffix(".parquet")])
    return report
