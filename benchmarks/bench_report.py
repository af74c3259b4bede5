"""``draco report`` memory and HTML size as the run grows.

    python benchmarks/bench_report.py [--sizes 10000,100000] [--against main] [--phases]
                                      [--priced]

Runs ``draco run`` once on the sample data (replayed calls, no network), then tiles that run
folder to each size: every table (rollouts, steps, rubrics, verdicts, rewards, step credit) is
repeated with suffixed ids, and the call log repeats its rows with request and response text
cut to 2,000 characters each (``--priced``: the rows become priced calls of a real provider,
each copy with a reply of its own, so billed-vs-naive has every row to count). For each size
it builds the report in a fresh process (``build_report`` and a write, as the command does)
and prints its wall time, peak RSS and HTML size, and the ratios of the largest size to the
smallest. Target (issue 19): peak memory flat (±20%) and HTML size sub-linear (ratio well
under the ratio of sizes).

``--against REF`` builds the same reports with the draco of git revision REF too (its
``draco_cli`` exported to a temporary folder), in turn on the same inputs, and prints its
figures beside this tree's. ``--phases`` prints, per size, each report section's peak RSS
(the peak is reset before each section through /proc/self/clear_refs).
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
from typing import Any

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import REPO, run_child  # noqa: E402

SAMPLE = REPO / "sample_data" / "appworld_mini"
TEXT_CHARS = 2000

CHILD = """
import sys, time
if sys.argv[3]:
    sys.path.insert(0, sys.argv[3])  # another revision's draco_cli
from pathlib import Path
import draco_cli.report as report
assert not sys.argv[3] or report.__file__.startswith(sys.argv[3]), report.__file__
if sys.argv[4]:
    import functools
    def status(key):
        with open('/proc/self/status') as f:
            return next(int(x.split()[1]) / 1024 for x in f if x.startswith(key))
    def traced(name, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            start = status('VmRSS')
            with open('/proc/self/clear_refs', 'w') as f:
                f.write('5')  # resets the peak (VmHWM) to the current RSS
            out = fn(*a, **k)
            print(f'phase {name} {start:.1f} {status("VmHWM"):.1f}', flush=True)
            return out
        return run
    for name in sys.argv[4].split(','):
        setattr(report, name, traced(name, getattr(report, name)))
t = time.perf_counter()
page = report.build_report([Path(sys.argv[1])])
Path(sys.argv[2]).write_text(page)
print(time.perf_counter() - t, len(page.encode()))
"""
# the sections build_report calls in turn (none calls another): their peaks do not nest
PHASES = ["_runs", "_connect", "_per_step", "_unanswered", "_verdicts", "_credit",
          "_distributions", "_criteria", "_over_steps", "_cost"]


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


def scale(src: Path, dst: Path, n: int, priced: bool = False) -> int:
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
    if priced:  # a priced model of a real provider, with usage and dollars on every row
        con.execute("UPDATE calls SET provider = 'openai', model = 'gpt-4.1-mini', "
                    "input_tokens = 1500, cached_tokens = 500, output_tokens = 200, "
                    "cost_usd = 0.00104")
    con.execute("CREATE TEMP TABLE one AS SELECT * FROM calls")
    for i in range(1, k):
        # with --priced each copy's reply is a reply of its own (billed vs naive counts
        # replies by their text)
        sel = ", ".join(f"substr({c}, 1, {TEXT_CHARS})" + (f" || ' {i}'" if priced and
                        c == "response" else "") if c in text else c for c in cols)
        con.execute(f"INSERT INTO calls ({', '.join(cols)}) SELECT {sel} FROM one")
    con.commit()
    con.close()
    return rollouts.height * k


def export(ref: str, dst: Path) -> Path:
    """``draco_cli`` as of git revision ``ref``, in ``dst``."""
    archive = subprocess.run(["git", "archive", ref, "draco_cli"], capture_output=True,
                             cwd=REPO, check=True).stdout
    dst.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst


def report(run: Path, out: Path, tree: Path | None, phases: bool) -> dict[str, Any]:
    """One report in a fresh process: seconds, peak RSS (MiB), HTML bytes, section peaks."""
    text, rss = run_child(CHILD, str(run), str(out), str(tree or ""),
                          ",".join(PHASES) if phases else "")
    lines = text.split("\n")
    secs, size = lines[-2].split()
    sections = [x.split()[1:] for x in lines if x.startswith("phase ")]
    return {"secs": float(secs), "rss": rss, "html": int(size),
            "phases": [(n, float(a), float(b)) for n, a, b in sections]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--against", help="also measure the draco of this git revision (e.g. main)")
    ap.add_argument("--phases", action="store_true", help="peak RSS of each report section")
    ap.add_argument("--priced", action="store_true",
                    help="the call log's rows as priced calls with a reply each")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-report-"))
    try:
        trees: dict[str, Path | None] = {"this tree": None}
        if args.against:
            trees = {args.against: export(args.against, tmp / "against"), **trees}
        src = template(tmp)
        got: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in trees}
        for n in sizes:
            d = tmp / f"run{n}"
            t = time.perf_counter()
            real = scale(src, d, n, args.priced)
            calls = sqlite3.connect(d / "llm_calls.sqlite").execute(
                "SELECT count(*) FROM calls").fetchone()[0]
            log_mb = (d / "llm_calls.sqlite").stat().st_size / 2**20
            print(f"{real:>7} rollouts, {calls} calls ({log_mb:.0f} MiB call log; built in "
                  f"{time.perf_counter() - t:.0f}s)")
            for name, tree in trees.items():
                r = got[name][n] = report(d, tmp / f"report{n}.html", tree, args.phases)
                print(f"  {name:>12}: report {r['secs']:6.1f} s, peak RSS {r['rss']:7.1f} MiB, "
                      f"HTML {r['html'] / 2**20:6.2f} MiB")
                for phase, start, peak in r["phases"]:
                    print(f"    {phase:<15} RSS before {start:6.1f}, peak {peak:6.1f} MiB "
                          f"(+{peak - start:.1f})")
            shutil.rmtree(d)
        lo, hi = sizes[0], sizes[-1]
        for name in trees:
            a, b = got[name][lo], got[name][hi]
            print(f"{name}: {hi}/{lo} = {hi / lo:.1f}x rollouts: peak RSS ratio "
                  f"{b['rss'] / a['rss']:.2f}x, HTML size ratio {b['html'] / a['html']:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
