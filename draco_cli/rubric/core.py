"""Rubrics (SPEC §3.1): dynamic ones written by an LLM in three stages (generate, union,
merge: docs/rubrics-and-judging.md), or one static set.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import polars as pl
from pydantic import BaseModel, Field

from draco_cli.errors import InputError
from draco_cli.schemas import Rubric, RubricCandidate, polars_schema
from draco_cli.llm.types import Answer, LLMRequest, Sampling, strict_schema
from draco_cli.prompts import load_prompt
from draco_cli.prompts.render import (ContextBlocks, RenderOptions, fenced, group_prefix,
                                     render_rollout, rollout_block, rollout_budget,
                                     rollout_prefix,
                                     stage_messages)

if TYPE_CHECKING:
    from draco_cli.llm.drive import Stage

STAGES = ("generate", "union", "merge")


class CriterionDraft(BaseModel):
    title: str = Field(description="At most 8 words.")
    requirement: str = Field(description="One sentence: what passing means.")


class CriteriaAnswer(BaseModel):
    criteria: list[CriterionDraft]


def criteria_schema(max_items: int) -> dict[str, Any]:
    """The answer schema sent: at least one criterion and at most ``max_items`` (a model that
    loops on one criterion stops at the bound instead of at the token limit)."""
    schema = strict_schema(CriteriaAnswer.model_json_schema())
    schema["properties"]["criteria"].update(minItems=1, maxItems=max(1, max_items))
    return schema


def criteria_check(max_items: int) -> Callable[[BaseModel], str | None]:
    """What the schema cannot say: no empty, repeated or surplus criterion (re-asked)."""

    def check(answer: BaseModel) -> str | None:
        assert isinstance(answer, CriteriaAnswer)  # the requests' answer_model
        if not answer.criteria:
            return "the criteria list is empty: propose at least one criterion"
        if len(answer.criteria) > max_items:
            return f"{len(answer.criteria)} criteria: give at most {max_items}"
        # A criterion given twice word for word says nothing new and is dropped where the
        # candidates are deduplicated; one title with two requirements is ambiguous: re-asked.
        seen: dict[str, tuple[int, str]] = {}
        for i, c in enumerate(answer.criteria, start=1):
            if not c.title.strip() or not c.requirement.strip():
                return f"criterion {i} has an empty title or requirement"
            key, requirement = normalise(c.title), normalise(c.requirement)
            if key in seen and seen[key][1] != requirement:
                return f"criterion {i} repeats the title of criterion {seen[key][0]} " \
                    f"({c.title.strip()!r}) with another requirement: give each criterion once"
            seen.setdefault(key, (i, requirement))
        return None

    return check


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", text.lower())).strip()


def criterion_id(group_id: str, title: str, requirement: str) -> str:
    """Stable id: the same criterion text in the same group always gets the same id."""
    digest = hashlib.sha256(f"{group_id}\n{normalise(title)}\n{normalise(requirement)}"
                            .encode()).hexdigest()
    return "c" + digest[:12]


@dataclass
class RubricResult:
    candidates: pl.DataFrame
    rubrics: pl.DataFrame
    groups_without_rubric: list[str] = field(default_factory=list)
    capped: int = 0
    # groups whose merge call went unanswered (after the client's retries): their deduplicated
    # candidates stand as the rubric, so the group is still judged; a rerun asks the merge again
    merge_fallback: list[str] = field(default_factory=list)


def _groups(rollouts: pl.DataFrame) -> list[tuple[str, str, list[str], str | None]]:
    """(group_id, instruction, members, task context) of each group, in order of appearance."""
    if "task_context" not in rollouts.columns:
        rollouts = rollouts.with_columns(pl.lit(None, dtype=pl.String).alias("task_context"))
    g = rollouts.group_by("group_id", maintain_order=True).agg(
        pl.col("instruction").first(), pl.col("rollout_id"), pl.col("task_context").first())
    return [(r["group_id"], r["instruction"], r["rollout_id"], r["task_context"])
            for r in g.iter_rows(named=True)]


def stage_requests(rollouts: pl.DataFrame, steps: pl.DataFrame, stages: tuple[str, ...],
                   max_criteria: int, render: RenderOptions, sampling: Sampling
                   ) -> list[tuple[str, str, str | None, LLMRequest]]:
    """The generate and union requests: (stage, group_id, origin rollout or None, request)."""
    by_rollout = {k[0]: v.sort("step")
                  for k, v in steps.partition_by("rollout_id", as_dict=True).items()}
    empty = steps.clear()
    out: list[tuple[str, str, str | None, LLMRequest]] = []
    context_of = ContextBlocks(render.redactor)
    for group_id, instruction, members, task_context in _groups(rollouts):
        context = context_of(task_context)  # first: the same bytes for every group
        budget = rollout_budget(render, context, instruction)
        whole = {rid: render_rollout(instruction, by_rollout.get(rid, empty), render, budget)
                 for rid in members}
        union: tuple[list[dict[str, str]], tuple[int, ...]] | None = None
        if "union" in stages:
            share = max(budget // max(len(members), 1), 500)
            blocks, cacheable = [], []
            for rid in members:
                steps = by_rollout.get(rid, empty)
                task, traj = render_rollout(instruction, steps, render, share)
                blocks.append(rollout_block(traj, steps.height))
                cacheable.append(traj == whole[rid][1])
            # First, the longest rollout its share of the budget left whole: in the same bytes
            # as its own calls, so the union reads that head from the cache its rubric call
            # left (the order of the attempts carries no meaning in the prompt).
            first = max((i for i, ok in enumerate(cacheable) if ok),
                        key=lambda i: len(blocks[i]), default=0)
            blocks.insert(0, blocks.pop(first))
            union = stage_messages([*group_prefix(context, task), *blocks[:1]],
                                   "".join(blocks[1:]) + load_prompt("union")[0].format(
                                       max_candidates=max_criteria))
        if "generate" in stages:
            template, version = load_prompt("generate")
            for rid in members:
                task, traj = whole[rid]
                messages = stage_messages(
                    rollout_prefix(context, task, traj, by_rollout.get(rid, empty).height),
                    template.format(max_candidates=max_criteria))
                out.append(("generate", group_id, rid, _criteria_request(
                    "generate", rid, version, messages, max_criteria, sampling)))
        if union is not None:
            out.append(("union", group_id, None, _criteria_request(
                "union", group_id, load_prompt("union")[1], union, max_criteria, sampling)))
    return out


def _criteria_request(phase: str, key: str, version: str,
                      messages: tuple[list[dict[str, str]], tuple[int, ...]],
                      max_criteria: int, sampling: Sampling) -> LLMRequest:
    """A call answered with criteria (generate, union, merge): ``messages`` with the positions
    of their cacheable head (``stage_messages``)."""
    return LLMRequest(
        phase=phase, key=key, answer_model=CriteriaAnswer, template_version=version,
        sampling=sampling, json_schema=criteria_schema(max_criteria), schema_name="criteria",
        check=criteria_check(max_criteria), messages=messages[0], cache_marks=messages[1])


def merge_request(group_id: str, instruction: str, candidates: list[dict[str, Any]],
                  max_criteria: int, render: RenderOptions, sampling: Sampling,
                  context: str = "") -> LLMRequest:
    """``context``: the group's rendered task-context block (``ContextBlocks``), or ""."""
    template, version = load_prompt("merge")
    red = render.redactor or (lambda s: s)
    listing = "\n".join(json.dumps({"title": c["title"], "requirement": c["requirement"]},
                                   ensure_ascii=False) for c in candidates)
    messages = stage_messages(
        group_prefix(context, red(instruction)),
        template.format(max_criteria=max_criteria)
        + f"\n\nCandidate criteria:\n{fenced('candidates', listing)}")
    return _criteria_request("merge", group_id, version, messages, max_criteria, sampling)


def dedupe(criteria: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[tuple[str, str]] = set()
    out = []
    for c in criteria:
        key = (normalise(c["title"]), normalise(c["requirement"]))
        if key not in seen and c["title"].strip() and c["requirement"].strip():
            seen.add(key)
            out.append(c)
    return out


def _cache_rounds(jobs: list[tuple[str, str, str | None, LLMRequest]]) -> list[list[int]]:
    """The jobs in the rounds that warm the provider's cache: one lead per task context (the
    first group's), then the other groups' leads, then the rest. A group's lead is the generate
    call whose rollout opens its union call (else the longest): its answer leaves the heads
    the group's other calls read. One round when there is nothing to warm."""
    union_head = {g: req.messages[1]["content"][:req.cache_prefix]
                  for stage, g, _, req in jobs if stage == "union"}
    best: dict[str, tuple[bool, int, int]] = {}
    for i, (stage, g, _, req) in enumerate(jobs):
        if stage != "generate":
            continue
        text = req.messages[1]["content"]
        rank = (text[:req.cache_prefix] == union_head.get(g), len(text), -i)
        if g not in best or rank > best[g]:
            best[g] = rank
    leads = sorted(-rank[2] for rank in best.values())
    by_context: dict[str, int] = {}
    for i in leads:   # a context head: the first of a generate call's three marks
        req = jobs[i][3]
        if len(req.cache_marks) == 3:
            by_context.setdefault(req.messages[1]["content"][:req.cache_marks[0]], i)
    if len(leads) == len(jobs):
        return [leads]
    first, lead_set = set(by_context.values()), set(leads)
    rounds = [sorted(first), [i for i in leads if i not in first],
              [i for i in range(len(jobs)) if i not in lead_set]]
    return [r for r in rounds if r]


def rubric_stage(rollouts: pl.DataFrame, steps: pl.DataFrame, *,
                 stages: tuple[str, ...] = STAGES, max_criteria: int = 8,
                 render: RenderOptions | None = None, sampling: Sampling | None = None,
                 pool: pl.DataFrame | None = None, warm: bool = True) -> Stage[RubricResult]:
    """The rubric stage as a generator of request lists (``draco_cli.llm.drive``). ``pool``:
    candidates another run wrote (``rubric_candidates``), merged instead of new ones.
    ``warm``: send each group's lead call a round ahead (online calls; a batch gains nothing
    and would wait for one more batch)."""
    render = render or RenderOptions()
    sampling = sampling or Sampling()
    jobs = stage_requests(rollouts, steps, stages, max_criteria, render, sampling)
    answers: list[list[Answer]] = []
    if jobs:
        # A provider's cache holds a prefix once its prefill is done, so calls sent together
        # each pay it: the leads go first (``_cache_rounds``), the rest read what they left.
        got: dict[int, list[Answer]] = {}
        for batch_of in (_cache_rounds(jobs) if warm else [list(range(len(jobs)))]):
            got.update(zip(batch_of, (yield [jobs[i][3] for i in batch_of])))
        answers = [got[i] for i in range(len(jobs))]
    cand_rows = []
    for (stage, group_id, origin, _), [answer] in zip(jobs, answers):
        if answer.status != "ok":
            continue
        for c in cast(CriteriaAnswer, answer.value).criteria[: max_criteria * 2]:  # status ok
            cand_rows.append({
                "group_id": group_id,
                "candidate_id": f"{stage}-" + hashlib.sha256(
                    f"{origin}\n{c.title}\n{c.requirement}".encode()).hexdigest()[:12],
                "stage": stage, "origin_rollout_id": origin,
                "title": c.title.strip(), "requirement": c.requirement.strip()})
    candidates = pl.DataFrame(cand_rows, schema=polars_schema(RubricCandidate))
    if pool is not None:   # merge on another run's candidates, this chunk's groups only
        candidates = pl.concat([candidates, pool.filter(pl.col("group_id").is_in(
            rollouts["group_id"].unique().implode())).select(candidates.columns)])
    candidates = candidates.unique(["group_id", "candidate_id"], keep="first", maintain_order=True)

    groups = _groups(rollouts)
    # Each group's deduplicated candidates, partitioned once (not filtered per group).
    by_group = {k[0]: dedupe(v.to_dicts())
                for k, v in candidates.partition_by("group_id", as_dict=True).items()}
    merged: dict[str, list[dict[str, Any]]] = {}   # groups whose merge answered
    fallback: list[str] = []                       # groups whose merge did not: candidates
    if "merge" in stages:
        context_of = ContextBlocks(render.redactor)
        merge_jobs = [(group_id, merge_request(group_id, instruction, by_group[group_id],
                                               max_criteria, render, sampling,
                                               context_of(task_context)))
                      for group_id, instruction, _, task_context in groups
                      if by_group.get(group_id)]
        answered = (yield [r for _, r in merge_jobs]) if merge_jobs else []
        for (group_id, _), [answer] in zip(merge_jobs, answered):
            if answer.status == "ok":
                merged[group_id] = dedupe([{**c.model_dump(), "source": "merge"}
                                           for c in cast(CriteriaAnswer, answer.value).criteria])
            else:
                fallback.append(group_id)
    rows, missing, capped = [], [], 0
    for group_id, *_ in groups:
        crit = merged[group_id] if group_id in merged else [
            {"title": c["title"], "requirement": c["requirement"], "source": c["stage"]}
            for c in by_group.get(group_id, [])]
        capped += max(len(crit) - max_criteria, 0)
        if not crit:
            missing.append(group_id)
        rows += [{"group_id": group_id,
                  "criterion_id": criterion_id(group_id, kept["title"], kept["requirement"]),
                  "title": kept["title"].strip(), "requirement": kept["requirement"].strip(),
                  "source": kept["source"]} for kept in crit[:max_criteria]]
    rubrics = pl.DataFrame(rows, schema=polars_schema(Rubric))
    return RubricResult(candidates, rubrics, missing, capped, fallback)


# --- static rubrics -----------------------------------------------------------------------


def load_static_rubric(path: str | Path | None) -> list[dict[str, str]]:
    """Criteria from YAML, JSON or Parquet (``title``, ``requirement``); None = the default
    shipped with draco."""
    if path is None:
        text = resources.files("draco_cli.rubric").joinpath("default.yaml").read_text()
        return _criteria_from(_yaml(text, "draco_cli/rubric/default.yaml"),
                              "draco_cli/rubric/default.yaml")
    p = Path(path)
    if not p.exists():
        raise InputError("no such rubric file", file=str(p))
    if p.is_dir():
        raise InputError("is a folder, expected a rubric file (.yaml, .json or .parquet)",
                         file=str(p))
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        from draco_cli.io import as_frame, read_arrow

        df = as_frame(read_arrow(p))
        for col in ("title", "requirement"):
            if col not in df.columns:
                raise InputError("missing column", file=str(p), field=col)
        return _criteria_from({"criteria": df.select("title", "requirement").to_dicts()}, str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start}): a rubric file is YAML or JSON",
                         file=str(p)) from None
    if "\x00" in text:
        raise InputError("binary data: a rubric file is YAML or JSON text", file=str(p))
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"not JSON ({exc.msg}, line {exc.lineno})", file=str(p)) from None
    elif suffix in (".yaml", ".yml"):
        data = _yaml(text, str(p))
    else:
        raise InputError("rubric files are .yaml, .yml, .json or .parquet", file=str(p))
    return _criteria_from(data, str(p))


def _yaml(text: str, source: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"not YAML ({exc})", file=source) from None


def _criteria_from(data: Any, source: str) -> list[dict[str, str]]:
    items = data.get("criteria") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise InputError("expected a non-empty list of criteria (or {criteria: [...]})",
                         file=source, field="criteria")
    out = []
    seen: dict[tuple[str, str], int] = {}
    for i, c in enumerate(items):
        if not isinstance(c, dict):
            raise InputError("a criterion must be a mapping", file=source, row=f"criterion {i}")
        for name in ("title", "requirement"):
            if not isinstance(c.get(name), str) or not c[name].strip():
                raise InputError("missing or empty", file=source, row=f"criterion {i}",
                                 field=name)
        key = (normalise(c["title"]), normalise(c["requirement"]))
        if key in seen:
            # The same text gets the same criterion id: two rows with one key downstream.
            raise InputError(f"repeats criterion {seen[key]} (same title and requirement)",
                             file=source, row=f"criterion {i}", field="title")
        seen[key] = i
        out.append({"title": c["title"].strip(), "requirement": c["requirement"].strip()})
    return out


def static_rubrics(rollouts: pl.DataFrame, criteria: list[dict[str, str]]) -> pl.DataFrame:
    """The same criteria for every group, ids per group (verdict keys stay unique)."""
    rows = [{"group_id": g, "criterion_id": criterion_id(g, c["title"], c["requirement"]),
             "title": c["title"], "requirement": c["requirement"], "source": "static"}
            for g in rollouts["group_id"].unique(maintain_order=True) for c in criteria]
    return pl.DataFrame(rows, schema=polars_schema(Rubric))
