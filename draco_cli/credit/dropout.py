"""Rubric dropout: a seeded share of each group's retained criteria is left out of a step's
reward and credit (after the discriminative filter), so a policy cannot lean on any one
criterion of the training judge.

Counts and seeding: docs/run.md, "Rubric dropout". The k left out are those with the smallest
hash of (seed, group_id, criterion_id)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import polars as pl

from draco_cli.errors import UsageError
from draco_cli.schemas import RubricDropout, polars_schema

DROPOUT_SCHEMA = polars_schema(RubricDropout)


def _uniform(*parts: object) -> float:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def check_dropout(p: float) -> bool:
    """Whether dropout is on (P > 0); a P outside [0, 1) is a usage error."""
    if not (isinstance(p, (int, float)) and 0.0 <= p < 1.0) or math.isnan(p):
        raise UsageError(f"--rubric-dropout {p!r}: give a share with 0 ≤ P < 1")
    return p > 0


def dropped_criteria(pairs: pl.DataFrame, p: float, seed: int) -> pl.DataFrame:
    """The (group_id, criterion_id) pairs left out, from the distinct retained pairs of
    ``pairs`` (columns group_id, criterion_id); one row each, with ``p`` and ``seed``."""
    empty = pl.DataFrame(schema=DROPOUT_SCHEMA)
    if p == 0 or not pairs.height:
        return empty
    rows: list[tuple[str, str]] = []
    uniq = pairs.select("group_id", "criterion_id").unique().sort("group_id", "criterion_id")
    for (gid,), g in uniq.group_by("group_id", maintain_order=True):
        crits = g["criterion_id"].to_list()
        k = min(int(math.floor(p * len(crits) + _uniform(seed, "count", gid))), len(crits) - 1)
        if k <= 0:
            continue
        order = np.argsort([_uniform(seed, gid, c) for c in crits], kind="stable")
        rows += [(str(gid), crits[i]) for i in order[:k]]
    if not rows:
        return empty
    return pl.DataFrame({"group_id": [g for g, _ in rows], "criterion_id": [c for _, c in rows],
                         "rubric_dropout": [float(p)] * len(rows),
                         "seed": [int(seed)] * len(rows)}, schema=DROPOUT_SCHEMA)


def apply_dropout(verdicts: pl.DataFrame, rollouts: pl.DataFrame, p: float, seed: int
                  ) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """``verdicts`` (``retained`` set, ``criterion_id``, ``__r`` the rollout row) with the
    dropped criteria's ``retained`` cleared, and the table of those criteria (None at P = 0:
    the verdicts come back untouched)."""
    if not check_dropout(p):
        return verdicts, None
    frame = pl.DataFrame({"group_id": rollouts["group_id"].gather(verdicts["__r"]),
                          "criterion_id": verdicts["criterion_id"],
                          "retained": verdicts["retained"].fill_null(False)})
    dropped = dropped_criteria(frame.filter(pl.col("retained")), p, seed)
    if not dropped.height:
        return verdicts, dropped
    hit = frame.join(dropped.select("group_id", "criterion_id").with_columns(
        pl.lit(True).alias("__d")), on=["group_id", "criterion_id"], how="left",
        maintain_order="left")["__d"].fill_null(False)
    return verdicts.with_columns(frame["retained"] & ~hit), dropped
