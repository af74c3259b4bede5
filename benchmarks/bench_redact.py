"""Default secret redaction: one combined pass against the previous pattern-by-pattern passes.

    python benchmarks/bench_redact.py [--repeat 20]

The texts are what the judge stage redacts: every action and observation (and instruction) of
the real tau-bench and tau2-bench rollouts in ../shared/data, one redaction call per text, as
``render_rollout`` makes them. Baselines, in the same run:
- ``before``: the nine default patterns of draco 0.x, each its own ``re.subn`` pass (what
  issue 19 measured at 0.34 ms per call);
- ``sequential``: today's (larger) pattern set, but one pass per pattern — what the combined
  expression saves.
It also prints the cost of redacting one judge request's texts (17: an instruction, 8 actions,
8 observations). The last line is ``redact_combined_over_before=<ratio>`` (time per call;
lower is better).

``--before FILE`` (a ``redact.py`` of another commit, e.g. ``git show REV:draco_cli/redact.py >
/tmp/redact_before.py``) measures that module's ``Redactor`` beside today's in the same run, in
MB/s of text, twice in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from draco_cli.redact import DEFAULT_PATTERNS, MASK, Redactor

DATA = Path(os.environ.get("DRACO_SHARED_DATA",
                         Path(__file__).resolve().parent.parent.parent / "shared" / "data"))

BEFORE = (
    r"sk-[A-Za-z0-9_\-]{16,}",
    r"(?:AKIA|ASIA)[A-Z0-9]{16}",
    r"gh[pousr]_[A-Za-z0-9]{30,}",
    r"xox[baprs]-[A-Za-z0-9\-]{10,}",
    r"(?i)(?<=bearer )[A-Za-z0-9._\-~+/]{12,}=*",
    r"(?i)(?<=\"password\": \")[^\"]+",
    r"(?i)(?<=password=)[^\s&'\",;]+",
    r"(?i)(?<=password: )[^\s'\",;]+",
    r"(?i)(?<=passwd=)[^\s&'\",;]+",
)


def texts() -> list[str]:
    out: list[str] = []
    for entry in json.loads((DATA / "tau-bench" / "gpt-4o-airline-15tasks.json").read_text()):
        out += [m.get("content") or "" for m in entry["traj"]]
    for sim in json.loads((DATA / "tau2-bench" / "gpt-4.1-airline-1trial.json").read_text())[
            "simulations"]:
        out += [m.get("content") or "" for m in sim["messages"]]
    return [t for t in out if isinstance(t, str)]


def per_call(fn, corpus: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for x in corpus:
            fn(x)
        best = min(best, time.perf_counter() - t)
    return best / len(corpus)


def passes(patterns) -> callable:
    compiled = [re.compile(p) for p in patterns]

    def run(text: str) -> str:
        for r in compiled:
            text = r.sub(MASK, text)
        return text
    return run


def throughput(corpus: list[str], before_file: Path, repeat: int) -> None:
    import importlib.util

    from draco_cli import redact as now

    spec = importlib.util.spec_from_file_location("redact_before", before_file)
    assert spec is not None and spec.loader is not None
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    mb = sum(len(t.encode()) for t in corpus) / 1e6
    for name, mod in (("before", before), ("after", now)) * 2:
        one = per_call(mod.Redactor(), corpus, repeat) * len(corpus)
        print(f"{name}: {mb / one:6.1f} MB/s ({mb:.2f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--before", type=Path, default=None)
    args = ap.parse_args()
    corpus = texts()
    if args.before is not None:
        throughput(corpus, args.before, args.repeat)
    chars = sum(map(len, corpus)) / len(corpus)
    before = per_call(passes(BEFORE), corpus, args.repeat)
    sequential = per_call(passes(DEFAULT_PATTERNS), corpus, args.repeat)
    combined = per_call(Redactor(), corpus, args.repeat)
    print(f"{len(corpus)} texts, {chars:.0f} chars on average")
    print(f"before ({len(BEFORE)} patterns, one pass each):     {before * 1e6:8.2f} µs/call")
    print(f"sequential ({len(DEFAULT_PATTERNS)} patterns, one pass each): "
          f"{sequential * 1e6:8.2f} µs/call")
    print(f"combined ({len(DEFAULT_PATTERNS)} patterns, one pass):        "
          f"{combined * 1e6:8.2f} µs/call")
    # Worst case: every text passes the prefilter, so the combined expression scans each.
    triggered = [t + " (password policy)" for t in corpus]
    before_t = per_call(passes(BEFORE), triggered, args.repeat)
    combined_t = per_call(Redactor(), triggered, args.repeat)
    print(f"every text triggering the prefilter: before {before_t * 1e6:.2f} µs/call, "
          f"combined {combined_t * 1e6:.2f} µs/call "
          f"(redact_triggered_combined_over_before={combined_t / before_t:.3f})")
    print(f"one judge request's 17 texts: {combined * 17 * 1e3:.3f} ms")
    print(f"redact_combined_over_sequential={combined / sequential:.3f}")
    print(f"redact_combined_over_before={combined / before:.3f}")


if __name__ == "__main__":
    main()
