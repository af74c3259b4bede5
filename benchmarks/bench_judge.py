"""The judge stage against its own client, at concurrency 64 on a local server with 50 ms
latency.

    python benchmarks/bench_judge.py [--rollouts 2000] [--repeat 2]

Both sides send the same 2,000 judge requests (rollouts built from the real tau-bench texts in
../shared/data, 8 steps each, groups of 8 with 6 criteria) through ``LLMClient`` to a server
running in another process, each with a fresh call log:
- ``client``: the requests built beforehand, then ``client.run`` timed alone;
- ``stage``: ``judge.score_stage`` driven by ``llm.drive.drive``, timed from the input tables
  to the verdict tables (rendering, redaction, hashing, calls, call-log rows, verdict tables);
- ``command``: the whole ``draco judge score`` command in a fresh process (start-up and
  imports, Parquet reads, the stage, the call log's Parquet copy, atomic writes).
The three alternate ``--repeat`` times; the best wall of each is kept. Last lines:
``judge_command_over_client=<ratio>`` and ``judge_stage_over_client=<ratio>`` (calls/s over
calls/s of the client alone).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DATA = REPO.parent / "shared" / "data"
if not DATA.exists():
    DATA = Path("/work/shared/data")

LATENCY = 0.05
CONCURRENCY = 64


def serve(port_q: mp.Queue) -> None:
    """A lean OpenAI-compatible server: it reads the criterion ids from the request's schema
    with one regex over the raw bytes and answers every one (pass, citing step 1) after
    ``LATENCY``, so its own CPU per call stays far below the client's."""
    import asyncio
    import re

    from aiohttp import web

    ids = re.compile(rb'"criterion_id":\s*\{"type":\s*"string",\s*"enum":\s*\[([^\]]*)\]')

    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        found = ids.search(raw)
        crit = json.loads(b"[" + found.group(1) + b"]") if found else []
        answer = json.dumps({"verdicts": [{"criterion_id": c, "verdict": "pass",
                                           "cited_steps": [1], "reason": "ok"} for c in crit]})
        await asyncio.sleep(LATENCY)
        return web.json_response({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 0,
            "model": "bench-model", "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": 3000, "completion_tokens": 120, "total_tokens": 3120}})

    async def start() -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        port_q.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(start())


def texts() -> list[str]:
    out: list[str] = []
    for entry in json.loads((DATA / "tau-bench" / "gpt-4o-airline-15tasks.json").read_text()):
        out += [m.get("content") or "" for m in entry["traj"]]
    return [t for t in out if isinstance(t, str) and t]


def tables(n: int):
    import polars as pl

    corpus = texts()
    rollouts, steps, rubrics = [], [], []
    k = 0
    for i in range(n):
        gid = f"g{i // 8}"
        rollouts.append({"rollout_id": f"r{i}", "group_id": gid, "task_id": gid,
                         "instruction": corpus[i % len(corpus)][:600]})
        for s in range(1, 9):
            steps.append({"rollout_id": f"r{i}", "step": s, "action": corpus[k % len(corpus)][:300],
                          "observation": corpus[(k + 7) % len(corpus)]})
            k += 1
    for g in range((n + 7) // 8):
        for c in range(6):
            rubrics.append({"group_id": f"g{g}", "criterion_id": f"g{g}-c{c}",
                            "title": f"criterion {c}", "source": "static",
                            "requirement": f"The agent checks condition {c} before acting "
                                           "and cites the step where it does."})
    return pl.DataFrame(rollouts), pl.DataFrame(steps), pl.DataFrame(rubrics)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OPENAI_API_KEY", "sk-bench-local-only")

    import polars as pl

    from draco_cli.judge.core import score_stage
    from draco_cli.llm.drive import drive
    from draco_cli.llm import CallLog, LLMClient
    from draco_cli.redact import Redactor
    from draco_cli.prompts.render import RenderOptions

    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=serve, args=(q,), daemon=True)
    proc.start()
    url = f"http://127.0.0.1:{q.get(timeout=30)}/v1"
    r, s, rb = tables(args.rollouts)
    render = RenderOptions(redactor=Redactor())
    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-judge-"))
    best = {"client": float("inf"), "stage": float("inf"), "command": float("inf")}
    for name, df in (("rollouts", r), ("steps", s), ("rubrics", rb)):
        df.write_parquet(tmp / f"{name}.parquet")
    cpu = {}
    try:
        for rep in range(args.repeat):
            for side in ("client", "stage", "command"):
                if side == "command":
                    t0 = time.perf_counter()
                    subprocess.run(
                        [sys.executable, "-m", "draco_cli", "judge", "score", "--rollouts",
                         str(tmp / "rollouts.parquet"), "--steps", str(tmp / "steps.parquet"),
                         "--rubrics", str(tmp / "rubrics.parquet"), "--model",
                         "openai/bench-model", "--base-url", url, "--concurrency",
                         str(CONCURRENCY), "--no-adapt", "-o", str(tmp / f"cmd{rep}")],
                        check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
                    wall = time.perf_counter() - t0
                    ok = pl.read_parquet(tmp / f"cmd{rep}" / "verdicts_raw.parquet")[
                        "verdict"].drop_nulls().len() // 6
                    print(f"command run {rep}: {args.rollouts} calls in {wall:5.2f} s = "
                          f"{args.rollouts / wall:7.1f} calls/s, {ok} answered", flush=True)
                    best[side] = min(best[side], wall)
                    continue
                with CallLog(tmp / f"{side}{rep}.sqlite") as log:
                    # a fixed concurrency (no adaptive probing): the ratio compares the two at
                    # C=64, not whichever level the probe settled on under the machine's load
                    client = LLMClient("openai/bench-model", call_log=log, base_url=url,
                                       concurrency=CONCURRENCY, adaptive=False)
                    if side == "client":
                        reqs = list(next(score_stage(r, s, rb, render=render)))
                        t0, c0 = time.perf_counter(), time.process_time()
                        out = client.run(reqs)
                        ok = sum(a.status == "ok" for x in out for a in x)
                    else:
                        t0, c0 = time.perf_counter(), time.process_time()
                        res = drive(score_stage(r, s, rb, render=render), client)
                        ok = res.raw.height // 6 - res.stats.unanswered_samples
                    wall, used = time.perf_counter() - t0, time.process_time() - c0
                print(f"{side:>6} run {rep}: {args.rollouts} calls in {wall:5.2f} s = "
                      f"{args.rollouts / wall:7.1f} calls/s, CPU {1000 * used / args.rollouts:.2f}"
                      f" ms/call, {ok} answered", flush=True)
                if wall < best[side]:
                    best[side], cpu[side] = wall, used
        size = (tmp / "stage0.sqlite").stat().st_size
        ratio = best["client"] / best["stage"]
        print(f"judge_command_over_client={best['client'] / best['command']:.2f}")
        print(f"bound {CONCURRENCY / LATENCY:.0f} calls/s; client {args.rollouts / best['client']:.0f}"
              f" calls/s, stage {args.rollouts / best['stage']:.0f} calls/s; call log "
              f"{size / args.rollouts / 1024:.1f} KiB per call; load average "
              f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        print(f"judge_stage_over_client={ratio:.2f}")
    finally:
        proc.terminate()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
