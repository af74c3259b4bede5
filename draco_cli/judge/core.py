"""Judging with citations (SPEC §3.2): one call per (rollout, sample) scores every criterion of
the rollout's group; samples are aggregated per criterion. The answer schema and how answers
are checked: see docs/rubrics-and-judging.md, "draco judge score".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, cast

import polars as pl
from pydantic import BaseModel

from draco_cli.choices import Aggregate
from draco_cli.llm.types import Answer, LLMRequest, RequestStream, Sampling
from draco_cli.prompts import load_prompt
from draco_cli.prompts.render import (ContextBlocks, RenderOptions, fenced, render_steps,
                                     rollout_budget, rollout_prefix, stage_messages,
                                     task_contexts)
from draco_cli.schemas import VerdictRaw, polars_schema

if TYPE_CHECKING:
    from draco_cli.llm.drive import Stage


class VerdictItem(BaseModel):
    criterion_id: str
    verdict: Literal["pass", "fail", "na"]
    cited_steps: list[int]
    reason: str


class ScoreAnswer(BaseModel):
    verdicts: list[VerdictItem]


def score_schema(criterion_ids: list[str], n_steps: int) -> dict[str, Any]:
    """Exactly one verdict per criterion (as many items as ids, ids from the group's list),
    citations bounded by the rollout's steps. Uniqueness of ids is checked after decoding
    (``verdict_check``): strict schema modes do not take ``uniqueItems`` on objects."""
    step = {"type": "integer", "enum": list(range(1, n_steps + 1))} if n_steps else \
        {"type": "integer"}
    cites: dict[str, Any] = {"type": "array", "items": step}
    if n_steps:
        cites["maxItems"] = n_steps
    item = {"type": "object", "additionalProperties": False,
            "required": ["criterion_id", "verdict", "cited_steps", "reason"],
            "properties": {
                "criterion_id": {"type": "string", "enum": criterion_ids},
                "verdict": {"type": "string", "enum": ["pass", "fail", "na"]},
                "cited_steps": cites,
                "reason": {"type": "string"}}}
    n = len(criterion_ids)
    return {"type": "object", "additionalProperties": False, "required": ["verdicts"],
            "properties": {"verdicts": {"type": "array", "items": item,
                                        "minItems": n, "maxItems": n}}}


def verdict_check(criterion_ids: list[str]) -> Callable[[BaseModel], str | None]:
    """Every criterion of the group answered exactly once, no other id: else re-asked."""
    wanted = list(criterion_ids)

    def check(answer: ScoreAnswer) -> str | None:
        got = [v.criterion_id for v in answer.verdicts]
        repeated = sorted({c for c in got if got.count(c) > 1})
        if repeated:
            return f"criterion ids repeated: {', '.join(repeated)}; give each id once"
        unknown = [c for c in got if c not in wanted]
        if unknown:
            return f"unknown criterion ids: {', '.join(unknown[:5])}"
        missing = [c for c in wanted if c not in got]
        if missing:
            return f"no verdict for criterion ids: {', '.join(missing)}; give one verdict " \
                "for every criterion listed"
        return None

    # The request's answer_model is ScoreAnswer, so the client only ever passes one.
    return cast("Callable[[BaseModel], str | None]", check)


def criteria_listing(criteria: pl.DataFrame) -> str:
    """The group's criteria, one JSON object per line (shared by the group's prompts)."""
    return "\n".join(json.dumps({"id": c["criterion_id"], "title": c["title"],
                                  "requirement": c["requirement"]}, ensure_ascii=False)
                      for c in criteria.iter_rows(named=True))


def _score_request(rollout_id: str, instruction: str, numbers: list[int], actions: list[str],
                   observations: list[str], ids: list[str], listing: str, samples: int,
                   sampling: Sampling, render: RenderOptions,
                   prompt: tuple[str, str], context: str = "", phase: str = "score") -> LLMRequest:
    """``context``: the rendered task-context block (``ContextBlocks``), or ""."""
    template, version = prompt
    task, traj = render_steps(instruction, numbers, actions, observations, render,
                              rollout_budget(render, context, instruction))
    m = len(numbers)
    # The rollout first (the same bytes as its rubric call's: one cached prefix per rollout),
    # then this stage's instructions and the group's criteria. The criteria were written by a
    # model that read rollouts: fenced as untrusted text too.
    messages, shared = stage_messages(
        rollout_prefix(context, task, traj, m),
        f"{template}\nCriteria (one JSON object per line):\n{fenced('criteria', listing)}")
    return LLMRequest(
        phase=phase, key=rollout_id, answer_model=ScoreAnswer, samples=samples,
        sampling=sampling, template_version=version, schema_name="verdicts",
        json_schema=score_schema(ids, m),
        check=verdict_check(ids), messages=messages, cache_marks=shared)


@dataclass
class ScoreStats:
    unknown_ids: int = 0
    citations_dropped: int = 0
    missing: int = 0
    unanswered_samples: int = 0


def verdict_rows(rollout_id: str, criteria_ids: list[str], n_steps: int, judge: str,
                 sample: int, answer: Answer, stats: ScoreStats) -> list[dict[str, Any]]:
    """Raw verdict rows of one answer, one per criterion of the group."""
    if answer.status != "ok":
        stats.unanswered_samples += 1
        return [{"rollout_id": rollout_id, "criterion_id": c, "judge": judge, "sample": sample,
                 "verdict": None, "cited_steps": [], "reason": answer.reason or answer.status}
                for c in criteria_ids]
    known = set(criteria_ids)
    got: dict[str, VerdictItem] = {}
    value = cast(ScoreAnswer, answer.value)  # status ok: a validated ScoreAnswer
    for given in value.verdicts:
        if given.criterion_id not in known:
            stats.unknown_ids += 1
        elif given.criterion_id not in got:  # a repeated id: the first answer stands
            got[given.criterion_id] = given
    rows: list[dict[str, Any]] = []
    for c in criteria_ids:
        item = got.get(c)
        if item is None:
            stats.missing += 1
            rows.append({"rollout_id": rollout_id, "criterion_id": c, "judge": judge,
                         "sample": sample, "verdict": None, "cited_steps": [],
                         "reason": "criterion missing from the judge's answer"})
            continue
        given_steps = set(item.cited_steps)
        cites = sorted(given_steps)
        if cites and (cites[0] < 1 or cites[-1] > n_steps):   # rare: steps out of 1..M
            cites = [s for s in cites if 1 <= s <= n_steps]
            stats.citations_dropped += len(given_steps) - len(cites)
        rows.append({"rollout_id": rollout_id, "criterion_id": c, "judge": judge,
                     "sample": sample, "verdict": item.verdict, "cited_steps": cites,
                     "reason": item.reason})
    return rows


RAW_SCHEMA = polars_schema(VerdictRaw)


def raw_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Raw verdict rows (``verdict_rows``) as a table, built column by column. Given rows,
    polars converts the ``cited_steps`` lists one Python list at a time (~80 ms for 12,000
    rows, serial work after the stage's last call); here they go in as one Arrow list array
    (~7 ms). The same table as ``pl.DataFrame(rows, schema=RAW_SCHEMA)``."""
    import numpy as np
    import pyarrow as pa

    lists = [r["cited_steps"] for r in rows]
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    cited = pl.Series("cited_steps", pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array([v for x in lists for v in x], pa.int32())))
    return pl.DataFrame([cited if name == "cited_steps" else
                         pl.Series(name, [r[name] for r in rows], dtype=dtype)
                         for name, dtype in RAW_SCHEMA.items()])


def aggregate_verdicts(raw: pl.DataFrame, how: Aggregate = "all") -> pl.DataFrame:
    """One verdict per (rollout, criterion, judge) from k samples (SPEC §3.2); the rules of
    ``all`` and ``majority``: docs/rubrics-and-judging.md, "draco judge score". Under
    ``majority`` a row with no answered sample is null."""
    keys = ["rollout_id", "criterion_id", "judge"]
    v = pl.col("verdict")
    counts = raw.group_by(keys, maintain_order=True).agg(
        pl.len().alias("k"), (v == "pass").sum().alias("np"), (v == "fail").sum().alias("nf"),
        (v == "na").sum().alias("nn"), v.is_not_null().sum().alias("na_"))
    answered = pl.col("na_")
    if how == "all":
        agg = (pl.when(pl.col("nf") > 0).then(pl.lit("fail"))
               .when(pl.col("np") == pl.col("k")).then(pl.lit("pass"))
               .when((answered > 0) & (pl.col("nn") == answered)).then(pl.lit("na"))
               .otherwise(None))
    else:
        top = pl.max_horizontal("nf", "nn", "np")
        agg = (pl.when(answered == 0).then(None)
               .when(pl.col("nf") == top).then(pl.lit("fail"))
               .when(pl.col("nn") == top).then(pl.lit("na"))
               .otherwise(pl.lit("pass")))
    counts = counts.with_columns(
        agg.alias("agg"),
        pl.when(answered == 0).then(pl.lit("no answer")).otherwise(pl.lit("samples disagree"))
        .alias("why_null"))
    joined = raw.join(counts.select(*keys, "agg", "why_null"), on=keys, how="left",
                      maintain_order="left")
    agree = joined.filter(pl.col("verdict") == pl.col("agg"))
    cites = agree.group_by(keys).agg(
        pl.col("cited_steps").explode().drop_nulls().unique().sort().alias("cited_steps"),
        pl.col("reason").first().alias("reason"))
    out = counts.select(*keys, pl.col("agg").alias("verdict"), "why_null").join(
        cites, on=keys, how="left", maintain_order="left")
    return out.select(
        *keys, "verdict",
        pl.col("cited_steps").fill_null(pl.lit([], dtype=pl.List(pl.Int32)))
        .cast(pl.List(pl.Int32)),
        pl.when(pl.col("verdict").is_null()).then(pl.col("why_null")).otherwise(pl.col("reason"))
        .alias("reason"))


@dataclass
class ScoreResult:
    raw: pl.DataFrame
    verdicts: pl.DataFrame
    stats: ScoreStats
    rollouts_without_rubric: int


def score_stage(rollouts: pl.DataFrame, steps: pl.DataFrame, rubrics: pl.DataFrame, *,
                samples: int = 1, aggregate: Aggregate = "all", judge: str = "judge",
                sampling: Sampling | None = None, render: RenderOptions | None = None,
                phase: str = "score") -> Stage[ScoreResult]:
    """The judge stage as a generator of request lists (``draco_cli.llm.drive``)."""
    render = render or RenderOptions()
    sampling = sampling or Sampling()
    # Per group once: its criterion ids and their listing (shared by the group's prompts).
    by_group = {k[0]: (v["criterion_id"].to_list(), criteria_listing(v))
                for k, v in rubrics.partition_by("group_id", as_dict=True).items()
                if v.height}
    # The steps sorted once and cut into per-rollout slices of plain lists.
    st = steps.select("rollout_id", "step", "action", "observation").sort(
        ["rollout_id", "step"], maintain_order=True)
    numbers, actions, observations = (st[c].to_list() for c in ("step", "action", "observation"))
    spans = {rid: (start, start + n) for rid, start, n in st.with_row_index("__i").group_by(
        "rollout_id").agg(pl.col("__i").first(), pl.len()).iter_rows()}
    del st
    ids_col, groups, instructions = (rollouts[c].to_list()
                                     for c in ("rollout_id", "group_id", "instruction"))
    context_of = ContextBlocks(render.redactor)
    contexts = task_contexts(rollouts, groups)  # one per group, not a string per rollout
    wanted = [i for i, g in enumerate(groups) if g in by_group]
    skipped = len(ids_col) - len(wanted)
    jobs: list[tuple[str, list[str], int]] = []
    prompt = load_prompt("score")

    def produce() -> Iterator[LLMRequest]:
        for i in wanted:
            rid = ids_col[i]
            ids, listing = by_group[groups[i]]
            a, b = spans.get(rid, (0, 0))
            jobs.append((rid, ids, b - a))
            yield _score_request(rid, instructions[i], numbers[a:b], actions[a:b],
                                 observations[a:b], ids, listing, samples, sampling, render,
                                 prompt, context_of(contexts.get(groups[i])), phase)

    # Built while the first calls are in flight (``RequestStream``).
    answers = (yield RequestStream(produce(), len(wanted) * samples)) \
        if wanted else []
    stats = ScoreStats()
    rows: list[dict[str, Any]] = []
    for (rid, ids, m), per_sample in zip(jobs, answers):
        for a in per_sample:
            rows += verdict_rows(rid, ids, m, judge, a.sample, a, stats)
    raw = raw_frame(rows)
    return ScoreResult(raw, aggregate_verdicts(raw, aggregate), stats, skipped)
