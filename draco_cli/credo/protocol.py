"""Driving a real environment through the replay protocol (``draco replay run``), resumably.

Requests, answers, transports and resume: see docs/credo.md, "The replay protocol".
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shlex
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast
from collections.abc import Callable

import polars as pl

from draco_cli.errors import UsageError
from draco_cli.llm.keys import scrub
from draco_cli.schemas import ReplayCost, ReplayLabel, polars_schema

PROTOCOL = "draco-replay/1"
LOG_NAME = "replay_log.jsonl"
COST_FIELDS = ("env_actions", "tokens", "reconstruction_actions", "reconstruction_tokens")
FAILURES_TO_STOP = 3   # replays failed in a row, none answered: the run stops there

# A request to the environment, and a record of the log (a checked answer): JSON objects.
Request = dict[str, Any]
Record = dict[str, Any]


@dataclass
class RunResult:
    labels: pl.DataFrame | None       # rollout_id, step, side, sample, return (None if incomplete)
    costs: pl.DataFrame               # rollout_id, step, env_actions, tokens, seconds
    done_before: int                  # replays found in the log from an earlier run
    ran: int                          # replays run now
    failures: list[str] = field(default_factory=list)
    not_tried: int = 0                # left when the environment failed every replay it began


def plan_digest(plan_df: pl.DataFrame) -> str:
    """Identifies the plan a log belongs to: its selected positions, K and seed."""
    sel = plan_df.filter(pl.col("selected")).select("rollout_id", "step").sort("rollout_id",
                                                                                "step")
    meta = [int(plan_df["seed"][0]) if "seed" in plan_df.columns else 0,
            int(plan_df["replays"][0]) if "replays" in plan_df.columns else None]
    h = hashlib.sha256(json.dumps(meta).encode())
    h.update(sel.write_csv().encode())
    return h.hexdigest()[:16]


def position_seed(plan_seed: int, rollout_id: str, step: int) -> int:
    d = hashlib.sha256(f"{plan_seed}\x1f{rollout_id}\x1f{step}".encode()).digest()
    return int.from_bytes(d[:8], "big") >> 1


def requests_of(plan_df: pl.DataFrame, replays: int | None) -> list[Request]:
    """The plan's selected positions as requests (its columns were checked by ``read_plan``)."""
    K = replays or (int(plan_df["replays"][0]) if "replays" in plan_df.columns else None)
    if not K or K < 1:
        raise UsageError("the plan records no K (replays): pass --replays")
    seed = int(plan_df["seed"][0]) if "seed" in plan_df.columns else 0
    digest = plan_digest(plan_df)
    task = "task_id" if "task_id" in plan_df.columns else None
    out = []
    for r in plan_df.filter(pl.col("selected")).iter_rows(named=True):
        out.append({"id": f"{r['rollout_id']}#{int(r['step'])}", "rollout_id": r["rollout_id"],
                    "step": int(r["step"]), "replays": K,
                    "seed": position_seed(seed, r["rollout_id"], int(r["step"])),
                    "task_id": r[task] if task else None, "plan": digest})
    return out


def check_answer(req: Request, ans: object) -> str | None:
    """Why an answer is unusable, or None."""
    if not isinstance(ans, dict):
        return "the answer is not a JSON object"
    if ans.get("id") != req["id"]:
        return f"the answer's id {ans.get('id')!r} is not the request's {req['id']!r}"
    if "error" in ans:
        return f"the environment refused: {str(ans['error'])[:200]}"
    K = req["replays"]
    for side in ("realized", "resampled"):
        v = ans.get(side)
        if not isinstance(v, list) or len(v) != K or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x == x for x in v):
            return f"{side} must be a list of {K} numbers"
    for key in COST_FIELDS:
        v = ans.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"{key} must be a non-negative integer"
    return None


class _Log:
    """Append-only JSON-lines log of finished replays; the first line names the plan."""

    def __init__(self, path: Path, digest: str, replace_other: bool):
        self.path = path
        self.lock = threading.Lock()
        self.done: dict[str, Record] = {}
        head: dict[str, Any] = {}
        if path.exists():
            lines = path.read_bytes().split(b"\n")
            try:
                head = json.loads(lines[0])
            except ValueError:
                head = {}
            if head.get("plan") != digest and not replace_other:
                raise UsageError(f"{path} is the log of another plan (or not a replay log): "
                                 "use another output folder, or --force to start over")
        if head.get("plan") == digest:
            good = len(lines[0]) + 1
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    break  # a line cut short by a kill: everything before it is whole
                self.done[rec["id"]] = rec
                good += len(line) + 1
            with open(path, "r+b") as f:  # drop a torn tail so appends start on a new line
                f.truncate(min(good, path.stat().st_size))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(json.dumps({"protocol": PROTOCOL, "plan": digest}).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
        self.f = open(path, "ab")  # noqa: SIM115 - held for the log's lifetime, closed by close()

    def add(self, rec: Record) -> None:
        with self.lock:
            self.f.write(json.dumps(rec).encode() + b"\n")
            self.f.flush()
            os.fsync(self.f.fileno())
            self.done[rec["id"]] = rec

    def close(self) -> None:
        self.f.close()


class _Subprocess:
    def __init__(self, cmd: str):
        try:
            self.p = subprocess.Popen(shlex.split(cmd), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, bufsize=1)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--env {cmd!r} could not start: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        # Popen with PIPEs: stdin and stdout are there
        self.stdin, self.stdout = cast("IO[str]", self.p.stdin), cast("IO[str]", self.p.stdout)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.said = ""   # the last line it wrote to stderr
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:  # a reader thread, so a silent environment can time out
        for line in self.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        for line in cast("IO[str]", self.p.stderr):
            if line.strip():
                self.said = line.strip()

    def ask(self, req: Request, timeout: float) -> object:
        self.stdin.write(json.dumps(req) + "\n")
        self.stdin.flush()
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.p.kill()
            raise TimeoutError(f"no answer within {timeout:g} s (the environment was stopped)") from None
        if line is None:
            try:
                code = self.p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = None
            said = f": {(scrub(self.said) or '')[:200]}" if self.said else ""
            raise RuntimeError(f"the environment exited (code {code}){said}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.stdin.close()
            self.p.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()


class _Http:
    def __init__(self, url: str):
        self.url = url

    def ask(self, req: Request, timeout: float) -> object:
        r = urllib.request.Request(self.url, data=json.dumps(req).encode(),
                                   headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return json.loads(resp.read())

    def close(self) -> None:
        pass


def _ask(conn: _Subprocess | _Http, req: Request, timeout: float, is_http: bool
         ) -> tuple[str | None, Record | None, bool]:
    """(why the answer is unusable or None, the answer, whether the connection is broken)."""
    try:
        ans = conn.ask(req, timeout)
        why = check_answer(req, ans)
    except (ValueError, OSError, RuntimeError, urllib.error.URLError) as exc:
        return (f"{type(exc).__name__}: {exc}"[:300], None,
                not is_http and not isinstance(exc, ValueError))
    # check_answer returned None only for a dict
    return why, (cast("Record", ans) if why is None else None), False


def _tables(recs: list[Record], complete: bool) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """(replay costs per position, labels: None until every position has its answer)."""
    costs = pl.DataFrame(
        [{"rollout_id": rec["rollout_id"], "step": rec["step"],
          **{k: rec.get(k, 0) for k in COST_FIELDS}, "seconds": rec["seconds"]}
         for rec in recs],
        schema=polars_schema(ReplayCost))
    if not complete:
        return costs, None
    labels = pl.DataFrame(
        [{"rollout_id": rec["rollout_id"], "step": rec["step"], "side": side, "sample": k,
          "return": float(v)}
         for rec in recs for side in ("realized", "resampled")
         for k, v in enumerate(rec[side])],
        schema=polars_schema(ReplayLabel))
    return costs, labels


def run_replays(plan_df: pl.DataFrame, env: str, log_path: Path, *, workers: int = 1,
                replays: int | None = None, replace_other: bool = False,
                timeout: float = 600.0,
                progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run every selected position of the plan not yet in the log, `workers` at a time. A log
    of another plan is an error unless `replace_other` (then it starts over)."""
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    reqs = requests_of(plan_df, replays)
    log = _Log(log_path, plan_digest(plan_df), replace_other)
    before = sum(1 for r in reqs if r["id"] in log.done)
    todo: queue.Queue[Request] = queue.Queue()
    for r in reqs:
        if r["id"] not in log.done:
            todo.put(r)
    failures: list[str] = []
    ran = [0]
    lock = threading.Lock()
    # an environment that fails every replay it begins (a wrong --env, a crash at start) stops
    # the run after a few, instead of failing every position one by one
    stop = threading.Event()
    tick = progress or (lambda done, total: None)
    is_http = env.startswith(("http://", "https://"))

    def connect() -> _Subprocess | _Http:
        return _Http(env) if is_http else _Subprocess(env)

    def worker() -> None:
        try:
            conn = connect()
        except UsageError as exc:
            with lock:
                failures.append(str(exc))
            return
        try:
            while not stop.is_set():
                try:
                    req = todo.get_nowait()
                except queue.Empty:
                    return
                t0 = time.monotonic()
                why, ans, broken = _ask(conn, req, timeout, is_http)
                if why or ans is None:
                    with lock:
                        failures.append(f"({req['rollout_id']!r}, step {req['step']}): {why}")
                        if ran[0] == 0 and len(failures) >= FAILURES_TO_STOP:
                            stop.set()
                    if broken:   # a pipe gone or hung: a fresh copy, or none if none starts
                        conn.close()
                        try:
                            conn = connect()
                        except UsageError:
                            return
                    continue
                log.add({"id": req["id"], "rollout_id": req["rollout_id"], "step": req["step"],
                         "realized": ans["realized"], "resampled": ans["resampled"],
                         **{k: ans.get(k, 0) for k in COST_FIELDS},
                         "seconds": round(time.monotonic() - t0, 6)})
                with lock:
                    ran[0] += 1
                    tick(before + ran[0], len(reqs))
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(min(workers, max(todo.qsize(), 1)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    recs = [log.done[r["id"]] for r in reqs if r["id"] in log.done]
    costs, labels = _tables(recs, len(recs) == len(reqs))
    return RunResult(labels, costs, before, ran[0], failures, todo.qsize())
