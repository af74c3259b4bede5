"""Reading a finished call log: its totals per phase and per endpoint, and its export as
Parquet (queryable with DuckDB or polars)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from draco_cli.errors import InputError
from draco_cli.llm.calllog import _connect
from draco_cli.llm.calllog_errors import _bad


def read_totals(path: str | Path) -> dict[str, dict[str, float]]:
    """Per-phase totals of a finished call log, read-only (no writer thread)."""
    conn = _connect(Path(path), readonly=True)
    out = {}
    try:
        for row in conn.execute(
            "SELECT phase, COUNT(*), SUM(status = 'ok'), SUM(input_tokens), SUM(cached_tokens), "
            "SUM(output_tokens), SUM(reasoning_tokens), SUM(cost_usd) FROM calls GROUP BY phase"
        ):
            totals = dict(zip(("rows", "answered", "input_tokens", "cached_tokens",
                               "output_tokens", "reasoning_tokens", "cost_usd"),
                              (x or 0 for x in row[1:])))
            if row[-1] is None:
                totals["cost_usd"] = None  # unpriced model: unknown, not $0
            out[row[0]] = totals
        return out
    except sqlite3.DatabaseError as exc:
        raise _bad(Path(path), f"corrupt call log ({exc})") from None
    finally:
        conn.close()


# SQLite's storage classes as the Arrow types polars inferred for them when the export read
# every row at once: any text makes a column String, else any real Float64, else Int64; a
# column with no value at all is written as the null type.
_EXPORT_BATCH_ROWS = 500
_EXPORT_GROUP_BYTES = 16 << 20


def export_parquet(log: str | Path, out: str | Path, force: bool = False) -> int:
    """Write the ``calls`` table as Parquet (atomically); return the row count. Streamed a few
    hundred rows at a time: request and response bodies make a call log large, and its export
    must not hold it all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from draco_cli.io import atomic_path

    if not Path(log).exists():
        raise InputError("no such call log", file=str(log))
    conn = _connect(Path(log), readonly=True)
    rows = 0
    try:
        names = [r[1] for r in conn.execute("PRAGMA table_info(calls)")]
        kinds = conn.execute("SELECT " + ", ".join(
            f"MAX(typeof(\"{c}\") = 'text'), MAX(typeof(\"{c}\") = 'real'), "
            f"MAX(typeof(\"{c}\") = 'integer')" for c in names) + " FROM calls").fetchone()
        types = []
        for i in range(len(names)):
            text, real, integer = kinds[3 * i: 3 * i + 3]
            types.append(pa.large_string() if text else pa.float64() if real else
                         pa.int64() if integer else pa.null())
        schema = pa.schema([pa.field(n, t) for n, t in zip(names, types)])
        cur = conn.execute(f"SELECT {', '.join(chr(34) + n + chr(34) for n in names)} "
                           "FROM calls ORDER BY id")
        with atomic_path(out, force) as tmp, \
                pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            group: list[pa.RecordBatch] = []
            size = 0
            while True:
                batch = cur.fetchmany(_EXPORT_BATCH_ROWS)
                more = bool(batch)
                if more:
                    cols = list(zip(*batch))
                    group.append(pa.record_batch(
                        [pa.array(c, type=t) for c, t in zip(cols, types)], schema=schema))
                    size += group[-1].nbytes
                    rows += len(batch)
                    del batch, cols
                # row groups of some size compress as well as one whole-table write
                if group and (not more or size >= _EXPORT_GROUP_BYTES):
                    writer.write_table(pa.Table.from_batches(group, schema=schema),
                                       row_group_size=1 << 30)
                    group, size = [], 0
                if not more:
                    break
    except sqlite3.DatabaseError as exc:
        raise _bad(Path(log), f"corrupt call log ({exc})") from None
    finally:
        conn.close()
    return rows


def endpoint_totals(path: str | Path) -> dict[str, dict[str, float | None]]:
    """Per endpoint of a fleet: HTTP calls, answered samples, failed attempts, mean latency of
    its answers (only rows that name an endpoint: a single --base-url leaves it empty)."""
    conn = _connect(Path(path), readonly=True)
    try:
        if "endpoint" not in {r[1] for r in conn.execute("PRAGMA table_info(calls)")}:
            return {}
        rows = conn.execute(
            "SELECT endpoint, COUNT(*), SUM(status = 'ok'), SUM(status = 'http_error'), "
            "AVG(CASE WHEN status = 'ok' THEN latency_s END) FROM calls "
            "WHERE endpoint IS NOT NULL GROUP BY endpoint ORDER BY endpoint").fetchall()
    finally:
        conn.close()
    return {e: {"rows": n, "answered": ok or 0, "failed": bad or 0,
                "mean_latency_s": round(lat, 4) if lat is not None else None}
            for e, n, ok, bad, lat in rows}
