"""``draco report`` memory and HTML size as the run grows.

    python benchmarks/bench_report.py [--sizes 10000,40000]

Runs ``draco run`` once on the sample data (replayed calls, no network), then tiles that run
folder to each size: every table (rollouts, steps, rubrics, verdicts, rewards, step credit) is
repeated with suffixed ids, and the call log repeats its rows with request and response text
cut to 2,000 characters each. For each size it builds the report in a fresh process
(``build_report`` and an atomic write, as the command does) and prints its wall time, peak
RSS and HTML size, and the ratios of the largest size to the smallest. Target (issue 19): peak
memory flat (±20%) and HTML size sub-linear (ratio well under the ratio of sizes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import REPO, run_child  # noqa: E402

SAMPLE = REPO / "sample_data" / "appworld_mini"
TEXT_CHARS = 2000

CHILD = """
import sys, time
from pathlib import Path
from draco_cli.report import build_report
t = time.perf_counter()
page = build_report([Path(sys.argv[1])])
Path(sys.argv[2]).write_text(page)
print(time.perf_counter() - t, len(page.encode()))
"""


def template(tmp: Path) -> Path:
    res = subprocess.run(
        [sys.executable, "-m", "draco_cli", "run", "--rollouts", str(SAMPLE / "rollouts.parquet"),
         "--steps", str(SAMPLE / "steps.parquet"), "--model",
         "replay/sample_data/llm_calls.sqlite", "--train-step", "0",
         "-o", str(tmp / "template")], capture_output=True, text=True, cwd=REPO)
    if res.returncode:
        raise SystemExit(f"draco run failed: {res.stderr}")
    return tmp / "template" / "step-0"


def _tile(df: pl.DataFrame, k: int, id_cols: list[str]) -> pl.DataFrame:
    copy = pl.Series("__copy", range(k)).to_frame().join(df, how="cross")
    return copy.with_columns(
        (pl.col(c) + "-" + pl.col("__copy").cast(pl.String)).alias(c) for c in id_cols
        if c in df.columns).drop("__copy").select(df.columns)


def scale(src: Path, dst: Path, n: int) -> int:
    """A copy of run folder ``src`` with its rollouts tiled to about ``n``; returns the count."""
    shutil.copytree(src, dst)
    rollouts = pl.read_parquet(SAMPLE / "rollouts.parquet")
    k = max(1, round(n / rollouts.height))
    ids = ["rollout_id", "group_id", "task_id"]
    inputs = {"rollouts": SAMPLE / "rollouts.parquet", "steps": SAMPLE / "steps.parquet"}
    manifest = json.loads((dst / "manifest.json").read_text())
    for name, path in inputs.items():
        out = dst.parent / f"{dst.name}-{name}.parquet"
        _tile(pl.read_parquet(path), k, ids).write_parquet(out)
        manifest["inputs"][name].update(path=str(out), relative=None)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    for p in dst.rglob("*.parquet"):
        if p.name == "llm_calls.parquet":
            p.unlink()  # stage copies of the call log: the report reads llm_calls.sqlite
            continue
        _tile(pl.read_parquet(p), k, ids).write_parquet(p)
    con = sqlite3.connect(dst / "llm_calls.sqlite")
    cols = [r[1] for r in con.execute("PRAGMA table_info(calls)") if r[1] != "id"]
    text = {"request", "response", "answer_text", "parsed"}
    sel = ", ".join(f"substr({c}, 1, {TEXT_CHARS})" if c in text else c for c in cols)
    con.execute("CREATE TEMP TABLE one AS SELECT * FROM calls")
    for _ in range(k - 1):
        con.execute(f"INSERT INTO calls ({', '.join(cols)}) SELECT {sel} FROM one")
    con.commit()
    con.close()
    return rollouts.height * k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,40000")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-report-"))
    try:
        src = template(tmp)
        got = {}
        for n in sizes:
            d = tmp / f"run{n}"
            t = time.perf_counter()
            real = scale(src, d, n)
            calls = sqlite3.connect(d / "llm_calls.sqlite").execute(
                "SELECT count(*) FROM calls").fetchone()[0]
            log_mb = (d / "llm_calls.sqlite").stat().st_size / 2**20
            out, rss = run_child(CHILD, str(d), str(tmp / f"report{n}.html"))
            secs, size = out.split()[-2:]
            got[n] = (rss, int(size))
            print(f"{real:>7} rollouts, {calls} calls ({log_mb:.0f} MiB call log; built in "
                  f"{time.perf_counter() - t:.0f}s): report {float(secs):6.1f} s, peak RSS "
                  f"{rss:7.1f} MiB, HTML {int(size) / 2**20:6.2f} MiB")
            shutil.rmtree(d)
        lo, hi = sizes[0], sizes[-1]
        print(f"{hi}/{lo} = {hi / lo:.1f}x rollouts: peak RSS ratio {got[hi][0] / got[lo][0]:.2f}x, "
              f"HTML size ratio {got[hi][1] / got[lo][1]:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
