"""A pure-Python reading of SPEC §3.3–3.6, written separately from draco_cli.credit (loops and
fractions, no polars) so the vectorised code can be compared against it on random inputs."""

from __future__ import annotations

import math
from fractions import Fraction

EPS = 1e-6


def reference(rollouts, steps, verdicts, *, credit="step", estimator="grpo", std="sample",
              drop="all-pass"):
    """rollouts: [{rollout_id, group_id}], steps: [{rollout_id, step, n_tokens}],
    verdicts: [{rollout_id, criterion_id, verdict, cited_steps}] (one judge).
    Returns ({rollout_id: (reward, advantage, mode)}, {(rollout_id, step): a_j})."""
    group_of = {r["rollout_id"]: r["group_id"] for r in rollouts}
    by_group = {}
    for v in verdicts:
        by_group.setdefault((group_of[v["rollout_id"]], v["criterion_id"]), []).append(v["verdict"])
    retained = {}
    for key, vs in by_group.items():
        keep = "fail" in vs
        if drop == "constant" and keep:
            keep = any(x in ("pass", "na") for x in vs)
        retained[key] = keep

    reward = {}
    for r in rollouts:
        rid = r["rollout_id"]
        mine = [v for v in verdicts if v["rollout_id"] == rid
                and retained[(r["group_id"], v["criterion_id"])]]
        p = sum(v["verdict"] == "pass" for v in mine)
        f = sum(v["verdict"] == "fail" for v in mine)
        reward[rid] = None if p + f == 0 else p / (p + f)

    adv = {}
    groups = {}
    for r in rollouts:
        groups.setdefault(r["group_id"], []).append(r["rollout_id"])
    for rids in groups.values():
        scored = [reward[i] for i in rids if reward[i] is not None]
        for i in rids:
            ri = reward[i]
            if ri is None or len(scored) <= 1 or max(scored) == min(scored):
                adv[i] = 0.0
            elif estimator == "rloo":
                adv[i] = ri - (sum(scored) - ri) / (len(scored) - 1)
            else:
                mu = sum(scored) / len(scored)
                if std == "none":
                    adv[i] = ri - mu
                else:
                    ddof = 1 if std == "sample" else 0
                    sd = math.sqrt(sum((x - mu) ** 2 for x in scored) / (len(scored) - ddof))
                    adv[i] = (ri - mu) / (sd + EPS)

    step_adv = {}
    modes = {}
    for r in rollouts:
        rid = r["rollout_id"]
        A = adv[rid]
        my_steps = sorted((s for s in steps if s["rollout_id"] == rid), key=lambda s: s["step"])
        M = len(my_steps)
        p = [0] * M
        f = [0] * M
        for v in verdicts:
            if v["rollout_id"] != rid or not retained[(r["group_id"], v["criterion_id"])]:
                continue
            if v["verdict"] not in ("pass", "fail"):
                continue
            for j in set(v["cited_steps"] or []):
                if 1 <= j <= M:
                    if v["verdict"] == "pass":
                        p[j - 1] += 1
                    else:
                        f[j - 1] += 1
        cited = [p[j] + f[j] > 0 for j in range(M)]
        if credit == "uniform" or not any(cited):
            modes[rid] = "uniform" if credit == "uniform" else "grpo_fallback"
            for s in my_steps:
                step_adv[(rid, s["step"])] = A
            continue
        modes[rid] = "step"
        Q = [Fraction(p[j], p[j] + f[j]) if cited[j] else None for j in range(M)]
        qbar = sum(q for q in Q if q is not None) / sum(cited)
        Q = [qbar if q is None else q for q in Q]
        w = [q if A >= 0 else 1 - q for q in Q]
        if sum(w) == 0:
            w = [Fraction(1, M)] * M
        N = sum(s["n_tokens"] for s in my_steps)
        for j, s in enumerate(my_steps):
            step_adv[(rid, s["step"])] = A * N * float(w[j] / sum(w)) / s["n_tokens"]
    return {i: (reward[i], adv[i], modes[i]) for i in reward}, step_adv
