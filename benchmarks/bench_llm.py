"""LLM-layer throughput against a local server with a fixed 200 ms latency.

    python benchmarks/bench_llm.py [--calls 2000]

Runs N calls through ``LLMClient`` (the real OpenAI SDK, aiohttp transport, one long-lived
client) at concurrency 64 and 256 and prints calls/s, CPU ms per call and the ratio to the
ideal bound concurrency / latency. Then reruns the 64 case: every answer must come from the
call log, with zero HTTP requests. The server runs in another process so it does not share a
core's event loop with the client. Last line: ``ratio_to_bound_c64=<value>``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LATENCY = 0.2


def serve(port_q: mp.Queue, hits: mp.Value) -> None:
    from tests.llm_server import FakeLLMServer

    s = FakeLLMServer(latency=LATENCY)
    original = s.chat

    async def counted(request):
        with hits.get_lock():
            hits.value += 1
        return await original(request)

    s.chat = counted
    s.start()
    port_q.put(s.port)
    while True:
        time.sleep(3600)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    os.environ.setdefault("OPENAI_API_KEY", "sk-bench-local-only")

    from pydantic import BaseModel

    from draco_cli.llm import CallLog, LLMClient, LLMRequest

    class Judgement(BaseModel):
        verdict: Literal["pass", "fail"]
        steps: list[int]
        reason: str

    q: mp.Queue = mp.Queue()
    hits = mp.Value("i", 0)
    proc = mp.Process(target=serve, args=(q, hits), daemon=True)
    proc.start()
    port = q.get(timeout=30)
    url = f"http://127.0.0.1:{port}/v1"

    def requests(tag: str) -> list:
        return [LLMRequest(phase="score", key=f"{tag}{i}", answer_model=Judgement,
                           messages=[{"role": "system", "content": "Judge the rollout."},
                                     {"role": "user", "content": f"rollout {tag}{i}"}])
                for i in range(args.calls)]

    tmp = Path(tempfile.mkdtemp(prefix="draco-bench-llm-"))
    ratios = {}
    try:
        for conc in (64, 256):
            with CallLog(tmp / f"c{conc}.sqlite") as log:
                client = LLMClient("openai/bench-model", call_log=log, base_url=url,
                                   concurrency=conc)
                reqs = requests(f"c{conc}-")
                t0, c0 = time.perf_counter(), time.process_time()
                out = client.run(reqs)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = sum(a.status == "ok" for r in out for a in r)
            bound = conc / LATENCY
            ratios[conc] = (args.calls / wall) / bound
            print(f"concurrency {conc:>3}: {args.calls} calls in {wall:6.2f} s = "
                  f"{args.calls / wall:7.1f} calls/s (bound {bound:.0f}/s, ratio "
                  f"{ratios[conc]:.2f}); client CPU {1000 * cpu / args.calls:.2f} ms/call; "
                  f"{ok} answered")
        before = hits.value
        with CallLog(tmp / "c64.sqlite") as log:
            client = LLMClient("openai/bench-model", call_log=log, base_url=url, concurrency=64)
            t0 = time.perf_counter()
            out = client.run(requests("c64-"))
            wall = time.perf_counter() - t0
        cached = sum(a.cached for r in out for a in r)
        print(f"cached rerun: {cached}/{args.calls} from the call log in {wall:.2f} s, "
              f"HTTP requests made: {hits.value - before}")
        print(json.dumps({"calls": args.calls, "latency_s": LATENCY,
                          "ratio_c64": round(ratios[64], 3), "ratio_c256": round(ratios[256], 3),
                          "rerun_http_requests": hits.value - before}))
        print(f"ratio_to_bound_c64={ratios[64]:.2f}")
    finally:
        proc.terminate()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
