"""LLM-layer throughput against a local server with a fixed 200 ms latency.

    python benchmarks/bench_llm.py [--calls 2000]

Runs N calls through ``LLMClient`` (the real OpenAI SDK, aiohttp transport, one long-lived
client, a fixed concurrency: no adaptive probing) at concurrency 64 and 256 and prints calls/s,
CPU ms per call and the ratio to the ideal bound concurrency / latency; then, in the same run,
the same calls through the plain ``openai`` SDK as a user would write them (``AsyncOpenAI``,
its default transport, ``chat.completions.create`` under a semaphore, answers validated with
the same pydantic model) — draco's lead over it is the ratio of the two. Then reruns the 64
case: every answer must come from the call log, with zero HTTP requests. The server runs in
another process so it does not share a core's event loop with the client. Last lines:
``ratio_to_bound_c64=<value>`` and ``ratio_to_bound_c256=<value>``.
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


def plain_sdk(url: str, conc: int, calls: int, model) -> tuple[float, float, int]:
    """The same calls through the plain openai SDK: (wall s, CPU s, answers that validate)."""
    import asyncio

    import openai

    schema = {"name": "judgement", "strict": True, "schema": model.model_json_schema()}

    async def go() -> int:
        sdk = openai.AsyncOpenAI(base_url=url, api_key="sk-bench-local-only", max_retries=0)
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> bool:
            async with sem:
                r = await sdk.chat.completions.create(
                    model="bench-model", max_tokens=4096,
                    response_format={"type": "json_schema", "json_schema": schema},
                    messages=[{"role": "system", "content": "Judge the rollout."},
                              {"role": "user", "content": f"rollout sdk{conc}-{i}"}])
                model.model_validate_json(r.choices[0].message.content)
                return True

        try:
            return sum(await asyncio.gather(*(one(i) for i in range(calls))))
        finally:
            await sdk.close()

    t0, c0 = time.perf_counter(), time.process_time()
    ok = asyncio.run(go())
    return time.perf_counter() - t0, time.process_time() - c0, ok


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
    ratios: dict[int, float] = {}
    sdk: dict[int, float] = {}
    try:
        for conc in (64, 256):
            with CallLog(tmp / f"c{conc}.sqlite") as log:
                client = LLMClient("openai/bench-model", call_log=log, base_url=url,
                                   concurrency=conc, adaptive=False)
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
                  f"{ok} answered", flush=True)
            p_wall, p_cpu, p_ok = plain_sdk(url, conc, args.calls, Judgement)
            sdk[conc] = args.calls / p_wall
            print(f"  plain openai SDK: {args.calls / p_wall:7.1f} calls/s (ratio "
                  f"{sdk[conc] / bound:.2f}), CPU {1000 * p_cpu / args.calls:.2f} ms/call, "
                  f"{p_ok} answered; draco over plain SDK {(args.calls / wall) / sdk[conc]:.2f}x",
                  flush=True)
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
                          "draco_over_sdk_c64": round(ratios[64] * 64 / LATENCY / sdk[64], 3),
                          "draco_over_sdk_c256": round(ratios[256] * 256 / LATENCY / sdk[256], 3),
                          "rerun_http_requests": hits.value - before}))
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        print(f"ratio_to_bound_c64={ratios[64]:.2f}")
        print(f"ratio_to_bound_c256={ratios[256]:.2f}")
    finally:
        proc.terminate()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
