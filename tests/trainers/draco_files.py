"""Token-advantage files made by draco's own pipeline from trainer-shaped rollouts.

Each rollout is a chat (user, assistant, [user, assistant]...) together with the trainer's
response token ids and response mask; draco ingests it with positions taken from those tokens
(``response_mask`` / ``response_ids``), a verdicts table with citations is written, and
``credit compute`` (step credit) writes ``token_advantages.parquet``. The trainer tests then
check that every trainer row receives exactly the values of the rollout it really is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from draco_cli.ingest import ingest
from draco_cli.io import write_table
from draco_cli.credit import credit_compute
from draco_cli.schemas import VerdictAggregated
from draco_cli.trainers.loader import load_token_advantages


@dataclass
class Rollout:
    rollout_id: str
    group: str
    response_ids: list[int]
    response_mask: list[int]
    texts: list[str] = field(default_factory=list)  # one per generated turn

    @property
    def turns(self) -> int:
        return len(self.texts)


def make_rollouts(rng: np.random.Generator, groups: list[str], n: int, *, lengths: str,
                  T: int, turns: int = 1, vocab: int = 1000, id_of=None) -> list[Rollout]:
    """``groups`` × ``n`` rollouts; ``lengths`` = "equal" (every response truncated at T, one
    turn: equal masks) or "random" (random turn and observation lengths)."""
    out = []
    for g in groups:
        for k in range(n):
            rid = id_of(g, k) if id_of else f"{g}_{k}"
            if lengths == "equal":
                mask = [1] * T
                texts = ["x"]
            else:
                mask, texts = [], []
                for t in range(turns):
                    gen = int(rng.integers(1, max(2, T // (2 * turns))))
                    mask += [1] * gen
                    texts.append(f"turn {t}")
                    if t < turns - 1:
                        mask += [0] * int(rng.integers(1, max(2, T // (4 * turns))))
            ids = rng.integers(3, vocab, size=len(mask)).tolist()
            out.append(Rollout(rid, g, ids, mask, texts))
    return out


def draco_token_file(tmp: Path, rollouts: list[Rollout], *, train_step: int | None = None,
                     rng: np.random.Generator | None = None, name: str = "run") -> Path:
    """Run draco (ingest with trainer tokens → verdicts → credit compute) on ``rollouts``."""
    rng = rng or np.random.default_rng(0)
    run = tmp / name
    run.mkdir(parents=True, exist_ok=True)
    log = run / "rollouts.jsonl"
    with log.open("w") as f:
        for r in rollouts:
            msgs = [{"role": "system", "content": "agent"}]
            for t, text in enumerate(r.texts):
                msgs.append({"role": "user", "content": f"observation {t}"})
                msgs.append({"role": "assistant", "content": text})
            entry = {"rollout_id": r.rollout_id, "task_id": r.group, "group_id": r.group,
                     "messages": msgs, "response_mask": r.response_mask,
                     "response_ids": r.response_ids}
            if train_step is not None:
                entry["train_step"] = train_step
            f.write(json.dumps(entry) + "\n")
    ingest("openai-jsonl", [log], run / "ingest")
    # Three criteria per rollout, pass/fail at random, each citing a random turn: rewards
    # differ within a group, so advantages differ in sign between its members.
    rows = []
    for r in rollouts:
        for c in range(3):
            rows.append({"rollout_id": r.rollout_id, "criterion_id": f"c{c}", "judge": "j",
                         "verdict": "pass" if rng.random() < 0.5 else "fail",
                         "cited_steps": [int(rng.integers(1, r.turns + 1))], "reason": ""})
    write_table(pl.DataFrame(rows), run / "verdicts.parquet", VerdictAggregated)
    credit_compute(run / "ingest" / "rollouts.parquet", run / "ingest" / "steps.parquet",
                   run / "verdicts.parquet", run / "credit")
    return run / "credit" / "token_advantages.parquet"


def expected_rows(path: Path | list[Path], true_ids: list[str | None], T: int) -> np.ndarray:
    """What row b must receive: the file's values of the rollout row b really is, padded
    to T (zeros for padding rows, ``None``)."""
    table = load_token_advantages(path)
    out = np.zeros((len(true_ids), T), dtype=np.float32)
    for b, rid in enumerate(true_ids):
        if rid is not None:
            adv = table.get(rid)
            out[b, : adv.size] = adv
    return out


def padded(rows: list[list[int]], T: int, value: int = 0) -> np.ndarray:
    out = np.full((len(rows), T), value, dtype=np.int64)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out
