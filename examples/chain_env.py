"""A small resettable stochastic environment that speaks draco's replay protocol.

An example of an environment adapter, kept outside the draco package: draco drives it as an
external program (`draco replay run --env "python examples/chain_env.py serve"`), exactly as it
would drive an AppWorld or tau2 adapter. Tests and benchmarks import its ChainEnv too.

Chain task of T binary decisions. The policy picks action 1 ("the right call") at step t with
probability σ(θ_t). The terminal evaluator succeeds with probability
base + gain·(fraction of right calls), so every decision matters a little. The state is
(t, right calls so far): restoring it is exact, which is what two-sided replay needs.

    python examples/chain_env.py generate --n 64 --seed 0 -o DIR   # rollouts, steps, positions
    python examples/chain_env.py serve --seed 0 [--delay S] [--served FILE]   # the protocol
    python examples/chain_env.py serve --seed 0 --http PORT                   # the same, HTTP

Rollout "r<i>" is the i-th trajectory drawn from numpy's generator seeded with (seed, i), so the
server restores any rollout's states from its id alone — a real adapter restores its own
snapshots instead. One request per line on stdin, one answer per line on stdout (see
docs/credo.md, "The replay protocol").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

DEFAULT_THETA = "0.2,-0.3,0.5,0.1"


@dataclass
class ChainEnv:
    theta: np.ndarray          # one logit per step
    base: float = 0.1
    gain: float = 0.8

    @property
    def T(self) -> int:
        return len(self.theta)

    def p_right(self, t: int) -> float:          # t is 0-based
        return 1 / (1 + math.exp(-self.theta[t]))

    def success_prob(self, right: int) -> float:
        return self.base + self.gain * right / self.T

    # -- sampling -------------------------------------------------------------------------

    def rollout(self, rng) -> tuple[list[int], float]:
        actions = [int(rng.random() < self.p_right(t)) for t in range(self.T)]
        return actions, float(rng.random() < self.success_prob(sum(actions)))

    def continue_from(self, t_next: int, right: int, rng) -> float:
        """Run from the state before decision ``t_next`` with ``right`` right calls so far."""
        for t in range(t_next, self.T):
            right += int(rng.random() < self.p_right(t))
        return float(rng.random() < self.success_prob(right))

    def replay(self, actions: list[int], t: int, K: int, rng) -> tuple[list[float], list[float]]:
        """Two-sided replay at decision t (0-based): realized side restores the state after
        it; resampled side restores the state before it and draws a fresh action."""
        before = sum(actions[:t])
        realized = [self.continue_from(t + 1, before + actions[t], rng) for _ in range(K)]
        resampled = [self.continue_from(t, before, rng) for _ in range(K)]
        return realized, resampled

    # -- exact quantities ------------------------------------------------------------------

    def value(self, t_next: int, right: int) -> float:
        """E[return] from the state before decision t_next (exact, by dynamic programming)."""
        if t_next == self.T:
            return self.success_prob(right)
        p = self.p_right(t_next)
        return p * self.value(t_next + 1, right + 1) + (1 - p) * self.value(t_next + 1, right)

    def credit(self, actions: list[int], t: int) -> float:
        before = sum(actions[:t])
        return self.value(t + 1, before + actions[t]) - self.value(t, before)

    def score(self, actions: list[int], t: int) -> np.ndarray:
        g = np.zeros(self.T)
        g[t] = actions[t] - self.p_right(t)
        return g

    def gradient(self) -> np.ndarray:
        """∇_θ E[return], exactly, by enumerating every action sequence."""
        g = np.zeros(self.T)
        for acts in itertools.product((0, 1), repeat=self.T):
            prob = math.prod(self.p_right(t) if a else 1 - self.p_right(t)
                             for t, a in enumerate(acts))
            r = self.success_prob(sum(acts))
            g += prob * r * sum(self.score(list(acts), t) for t in range(self.T))
        return g


# -- the replay protocol ------------------------------------------------------------------


def rollout_actions(env: ChainEnv, seed: int, index: int) -> tuple[list[int], float]:
    return env.rollout(np.random.default_rng([seed, index]))


def answer(env: ChainEnv, seed: int, request: dict) -> dict:
    """One replay request → its answer: K realized and K resampled returns, and the cost."""
    rid, t, K = request["rollout_id"], int(request["step"]), int(request["replays"])
    if not (isinstance(rid, str) and rid.startswith("r") and rid[1:].isdigit()):
        return {"id": request.get("id"), "error": f"unknown rollout {rid!r}"}
    if not 1 <= t <= env.T:
        return {"id": request.get("id"), "error": f"step {t} outside 1..{env.T}"}
    actions, _ = rollout_actions(env, seed, int(rid[1:]))
    rng = np.random.default_rng([int(request["seed"]) % 2**63])
    realized, resampled = env.replay(actions, t - 1, K, rng)
    # realized: restore after step t, run the remaining T − t; resampled: a fresh action then
    # the remaining steps, T − t + 1 actions; each K times
    actions_run = K * (env.T - t) + K * (env.T - t + 1)
    return {"id": request["id"], "realized": realized, "resampled": resampled,
            "env_actions": actions_run, "tokens": 0}


def serve(env: ChainEnv, seed: int, delay: float, served: str | None) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            out = answer(env, seed, request)
        except (ValueError, KeyError, TypeError) as exc:
            out = {"id": None, "error": f"bad request: {exc}"}
        if delay:
            time.sleep(delay)
        if served and "error" not in out:
            with open(served, "a") as f:
                f.write(json.dumps(out["id"]) + "\n")
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def serve_http(env: ChainEnv, seed: int, port: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                out = answer(env, seed, json.loads(body))
            except (ValueError, KeyError, TypeError) as exc:
                out = {"id": None, "error": f"bad request: {exc}"}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    server.serve_forever()


def generate(env: ChainEnv, seed: int, n: int, out: str) -> None:
    """Rollouts, steps and positions (true credit as a column, for checks) of n rollouts."""
    from pathlib import Path

    import polars as pl

    rows, steps, pos = [], [], []
    for i in range(n):
        actions, ret = rollout_actions(env, seed, i)
        rid = f"r{i}"
        rows.append({"rollout_id": rid, "group_id": f"g{i // 8}", "task_id": f"g{i // 8}",
                     "outcome": ret, "n_turns": env.T})
        for t in range(env.T):
            steps.append({"rollout_id": rid, "step": t + 1, "action": str(actions[t]),
                          "n_tokens": 1})
            pos.append({"rollout_id": rid, "step": t + 1, "prediction": 0.0, "error": 0.25,
                        "true_credit": env.credit(actions, t),
                        "score_norm": abs(actions[t] - env.p_right(t))})
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows).write_parquet(d / "rollouts.parquet")
    pl.DataFrame(steps).write_parquet(d / "steps.parquet")
    pl.DataFrame(pos).write_parquet(d / "positions.parquet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["serve", "generate"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--theta", default=DEFAULT_THETA, help="One logit per step, comma-separated.")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("-o", "--out", default=".")
    ap.add_argument("--delay", type=float, default=0.0, help="Seconds per answer (tests).")
    ap.add_argument("--served", help="Append the id of every answered request to this file.")
    ap.add_argument("--http", type=int, help="Serve HTTP POST on this port (0 = any).")
    a = ap.parse_args()
    env = ChainEnv(theta=np.array([float(x) for x in a.theta.split(",")]))
    if a.command == "generate":
        generate(env, a.seed, a.n, a.out)
    elif a.http is not None:
        serve_http(env, a.seed, a.http)
    else:
        serve(env, a.seed, a.delay, a.served)


if __name__ == "__main__":
    main()
