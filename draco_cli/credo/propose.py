"""Rubric evolution with LLM-proposed edits (SPEC §6, CREDO §3.6; ``draco replay propose``).

See docs/credo.md, "LLM-proposed edits". The rubric is one set applied to every group:
features must carry across groups, so edits do too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Literal, cast
from collections.abc import Callable

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

from draco_cli.credo.evolve import objective
from draco_cli.credo.heads import draco_features, fit_heads, task_split, training_rows
from draco_cli.errors import InputError, UsageError
from draco_cli.schemas import EvolveScore, polars_schema

if TYPE_CHECKING:
    from draco_cli.llm.client import LLMClient
    from draco_cli.llm.types import LLMRequest, Progress

PROMPT_VERSION = "evolve.v1"
PHASE = "evolve"


class Edit(BaseModel):
    op: Literal["add", "remove", "merge"]
    keys: list[str] = Field(default_factory=list)
    title: str = ""
    requirement: str = ""
    reason: str = ""


class EditsAnswer(BaseModel):
    edits: list[Edit]


@dataclass
class EvolveResult:
    scores: pl.DataFrame          # one row per candidate (current rubric first)
    rubrics: pl.DataFrame         # the accepted rubric (the current one if nothing accepted)
    verdicts: pl.DataFrame        # verdicts under the accepted rubric
    accepted: str | None          # the accepted edit's label
    notes: list[str]


def rubric_keys(rubrics: pl.DataFrame) -> pl.DataFrame:
    """The distinct criteria of a shared rubric, keyed c1, c2, ... by first appearance; one row
    per (group_id, criterion_id) with its key."""
    from draco_cli.rubric.core import normalise

    text = rubrics.with_columns(pl.concat_str(
        pl.col("title").map_elements(normalise, return_dtype=pl.String), pl.lit("\x1f"),
        pl.col("requirement").map_elements(normalise, return_dtype=pl.String)).alias("__text"))
    order = text.select("__text").unique(maintain_order=True).with_row_index("__k", offset=1)
    per_group = text.group_by("group_id").agg(pl.col("__text").n_unique().alias("n"))
    if per_group["n"].n_unique() > 1 or per_group["n"][0] != order.height:
        raise InputError("rubric evolution needs one set of criteria shared by every group (a "
                         "static rubric): these groups have different criteria", field="title")
    return text.join(order, on="__text").with_columns(
        pl.format("c{}", pl.col("__k")).alias("key")).drop("__text", "__k")


def apply_edit(rubrics: pl.DataFrame, keyed: pl.DataFrame, edit: Edit
               ) -> tuple[pl.DataFrame, list[str], dict[str, str] | None]:
    """(edited rubric, criterion ids removed, new criterion {title, requirement} or None)."""
    from draco_cli.rubric.core import criterion_id

    known = set(keyed["key"])
    bad = [k for k in edit.keys if k not in known]
    need = {"add": 0, "remove": 1, "merge": 2}[edit.op]
    if bad or len(set(edit.keys)) != need:
        raise ValueError(f"{edit.op} needs {need} known key(s), got {edit.keys}")
    if edit.op != "remove" and not (edit.title.strip() and edit.requirement.strip()):
        raise ValueError(f"{edit.op} needs a title and a requirement")
    removed = keyed.filter(pl.col("key").is_in(edit.keys))["criterion_id"].to_list()
    kept = rubrics.filter(~pl.col("criterion_id").is_in(removed))
    new = None
    if edit.op != "remove":
        new = {"title": edit.title.strip(), "requirement": edit.requirement.strip()}
        groups = rubrics["group_id"].unique(maintain_order=True).to_list()
        if criterion_id(groups[0], new["title"], new["requirement"]) in set(
                rubrics["criterion_id"]):
            raise ValueError("the new criterion is already in the rubric")
        kept = pl.concat([kept, pl.DataFrame(
            [{"group_id": g, "criterion_id": criterion_id(g, new["title"], new["requirement"]),
              "title": new["title"], "requirement": new["requirement"], "source": "evolve"}
             for g in groups], schema=kept.schema)])
    return kept, removed, new


def outcome_auc(rewards: pl.DataFrame, rollouts: pl.DataFrame) -> float | None:
    """P(reward of a success > reward of a failure), ties half: how well the rubric's reward
    discriminates the terminal outcome."""
    j = rewards.select("rollout_id", "reward").join(
        rollouts.select("rollout_id", "outcome"), on="rollout_id").drop_nulls()
    pos = j.filter(pl.col("outcome") >= 1 - 1e-6)["reward"].to_numpy()
    neg = j.filter(pl.col("outcome") < 1 - 1e-6)["reward"].to_numpy()
    if pos.size == 0 or neg.size == 0:
        return None
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def _features_of(rollouts: pl.DataFrame, steps: pl.DataFrame, verdicts: pl.DataFrame
                 ) -> tuple[pl.DataFrame, pl.DataFrame]:
    from draco_cli.credit import compute_credit

    res = compute_credit(rollouts, steps, verdicts.drop("retained", strict=False))
    return draco_features(res.step_credit, res.rewards), res.rewards


def _score(plan_df: pl.DataFrame, labels: pl.DataFrame, rollouts: pl.DataFrame,
           features: pl.DataFrame, train: set[str], held: set[str], ridge: float
           ) -> tuple[float, float]:
    h = fit_heads(plan_df.filter(pl.col("rollout_id").is_in(list(train))), labels, features,
                  ridge)
    te = training_rows(plan_df.filter(pl.col("rollout_id").is_in(list(held))), labels,
                        features)
    if "score_norm" in plan_df.columns:
        te = te.join(plan_df.select("rollout_id", pl.col("step").cast(pl.Int64), "score_norm"),
                     on=["rollout_id", "step"], how="left")
    c, _ = h.predict(te)
    return objective(te, c)


def proposal_request(rubric_lines: list[str], evidence: list[str], max_edits: int
                     ) -> LLMRequest:
    from draco_cli.llm.types import LLMRequest, Sampling

    template = resources.files("draco_cli.prompts").joinpath(f"{PROMPT_VERSION}.txt") \
        .read_text().format(max_edits=max_edits)
    return LLMRequest(
        phase=PHASE, key="propose", answer_model=EditsAnswer, template_version=PROMPT_VERSION,
        schema_name="edits", sampling=Sampling(max_tokens=2048),
        messages=[{"role": "system", "content": template},
                  {"role": "user", "content": "Rubric (one JSON object per line):\n"
                   + "\n".join(rubric_lines) + "\n\nSteps with the largest prediction errors:\n"
                   + "\n\n".join(evidence)}])


def _evidence(plan_df: pl.DataFrame, labels: pl.DataFrame, rollouts: pl.DataFrame,
              steps: pl.DataFrame, verdicts: pl.DataFrame, keyed: pl.DataFrame,
              features: pl.DataFrame, train: set[str], held: set[str], ridge: float,
              n: int) -> list[str]:
    from draco_cli.prompts.render import fenced, shorten

    h = fit_heads(plan_df.filter(pl.col("rollout_id").is_in(list(train))), labels, features,
                  ridge)
    te = training_rows(plan_df.filter(pl.col("rollout_id").is_in(list(held))), labels,
                        features)
    c, _ = h.predict(te)
    p = te["p"].to_numpy()
    weight = (1 / p) * ((1 - p) / p) * (te["delta"].to_numpy() - c) ** 2
    if not np.any(weight > 0):  # every held-out position replayed with p = 1: plain error
        weight = (te["delta"].to_numpy() - c) ** 2
    order = np.argsort(-weight)[:n]
    key_of = dict(zip(keyed["criterion_id"], keyed["key"]))
    v = verdicts.with_columns(pl.col("cited_steps").fill_null([]))
    out = []
    for i in order:
        rid, t = te["rollout_id"][int(i)], int(te["step"][int(i)])
        st = steps.filter((pl.col("rollout_id") == rid) & (pl.col("step") == t))
        action = shorten(st["action"][0], 600) if st.height else ""
        said = [f"{key_of.get(r['criterion_id'], '?')}: {r['verdict']}"
                for r in v.filter(pl.col("rollout_id") == rid).iter_rows(named=True)
                if t in (r["cited_steps"] or [])]
        out.append(f"predicted {c[int(i)]:+.3f}, measured {te['delta'][int(i)]:+.3f}; "
                   f"criteria citing this step: {', '.join(said) or 'none'}\n"
                   + fenced(f"step {t}", action))
    return out


def evolve_round(plan_df: pl.DataFrame, labels: pl.DataFrame, rollouts: pl.DataFrame,
                 steps: pl.DataFrame, rubrics: pl.DataFrame, verdicts: pl.DataFrame,
                 client: LLMClient, *, max_edits: int = 3, evidence: int = 8, ridge: float = 1.0,
                 holdout: float = 0.2, judge_label: str = "judge",
                 progress: Callable[[Progress], None] | None = None) -> EvolveResult:
    from draco_cli.judge.core import score_stage
    from draco_cli.llm.drive import drive

    if max_edits < 1:
        raise UsageError("--max-edits must be at least 1")
    keyed = rubric_keys(rubrics)
    train, held = task_split(rollouts, holdout)
    if not train or not held:
        raise UsageError("the split by task left one side empty: change --holdout")
    F0, rw0 = _features_of(rollouts, steps, verdicts)
    obj0, mse0 = _score(plan_df, labels, rollouts, F0, train, held, ridge)
    rows = [{"candidate": "current rubric", "held_out_objective": obj0, "held_out_mse": mse0,
             "outcome_auc": outcome_auc(rw0, rollouts), "criteria": keyed["key"].n_unique()}]
    lines = [json.dumps({"key": k, "title": t, "requirement": r}, ensure_ascii=False)
             for k, t, r in keyed.unique("key", maintain_order=True)
             .select("key", "title", "requirement").iter_rows()]
    ev = _evidence(plan_df, labels, rollouts, steps, verdicts, keyed, F0, train, held, ridge,
                   evidence)
    answer = client.run([proposal_request(lines, ev, max_edits)], progress=progress)[0][0]
    notes: list[str] = []
    if answer.value is None:
        notes.append(f"the proposal call was not answered ({answer.reason or 'no answer'}): "
                     "no edit to score")
        edits: list[Edit] = []
    else:
        # the request's answer_model: the client parsed the answer into it
        edits = list(cast(EditsAnswer, answer.value).edits)[:max_edits]
    candidates: dict[str, tuple[pl.DataFrame, pl.DataFrame]] = {}
    for n, edit in enumerate(edits, start=1):
        label = f"edit {n}: {edit.op} {' '.join(edit.keys)}".strip()
        row = {"candidate": label, "op": edit.op, "title": edit.title or None,
               "reason": edit.reason or None}
        try:
            rb, removed, new = apply_edit(rubrics, keyed, edit)
        except ValueError as exc:
            rows.append({**row, "error": str(exc)})
            continue
        v = verdicts.filter(~pl.col("criterion_id").is_in(removed))
        if new is not None:
            fresh = rb.filter(pl.col("source") == "evolve")
            scored = drive(score_stage(rollouts, steps, fresh, judge=judge_label, phase=PHASE),
                           client, progress=progress)
            v = pl.concat([v.drop("retained", strict=False),
                           scored.verdicts.select(v.drop("retained", strict=False).columns)])
        F, rw = _features_of(rollouts, steps, v)
        obj, mse = _score(plan_df, labels, rollouts, F, train, held, ridge)
        rows.append({**row, "held_out_objective": obj, "held_out_mse": mse,
                     "outcome_auc": outcome_auc(rw, rollouts),
                     "criteria": rb.select("title", "requirement").unique().height})
        candidates[label] = (rb, v)
    scores = pl.DataFrame(rows, schema=polars_schema(EvolveScore))  # absent keys: null
    edited = scores.filter(pl.col("held_out_objective").is_not_null()
                           & (pl.col("candidate") != "current rubric"))
    accepted = None
    if edited.height:
        best = edited.sort("held_out_objective").row(0, named=True)
        if best["held_out_objective"] < obj0:
            accepted = best["candidate"]
    for metric, better in (("held_out_mse", "min"), ("outcome_auc", "max")):
        pick = scores.drop_nulls(metric).sort(metric, descending=better == "max")
        if pick.height:
            notes.append(f"by {metric} alone the pick would be: {pick['candidate'][0]}")
    scores = scores.with_columns((pl.col("candidate") == pl.lit(accepted)).fill_null(False)
                                 .alias("accepted"))
    rb, v = candidates[accepted] if accepted else (rubrics, verdicts)
    return EvolveResult(scores, rb, v, accepted, notes)
