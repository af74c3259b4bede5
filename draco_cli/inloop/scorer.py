"""The in-loop Python API: ``Scorer.score_group`` runs ``draco run``'s stages on one group as soon
as its rollouts finish, the groups of one ``Scorer`` sharing one call log, concurrency limit and
per-call ``deadline``. See docs/inloop.md. Nothing here writes a table to disk; the call log is
the only file."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import polars as pl
import pyarrow as pa

from draco_cli.errors import InputError, UsageError
from draco_cli.llm.calllog import CallLog
from draco_cli.llm.drive import adrive
from draco_cli.llm.settings import LLMSettings
from draco_cli.llm.types import Sampling
from draco_cli.options import CreditOptions, RunOptions
from draco_cli.schemas import Rollout, Rubric, Step, polars_schema

if TYPE_CHECKING:
    from draco_cli.llm.client import LLMClient
    from draco_cli.llm.types import Answer, LLMRequest, Progress

_ROLLOUT_COLUMNS = ["rollout_id", "group_id", "task_id", "instruction", "outcome",
                    "response_len", "train_step", "response_fingerprint", "task_context"]
_STEP_COLUMNS = ["rollout_id", "step", "action", "observation", "n_tokens", "token_start"]


@dataclass
class CallTally:
    """What one group's LLM calls came to (samples, not HTTP attempts)."""

    answered: int = 0        # answered by a call made for this group
    cached: int = 0          # answered from the call log: paid before, free now
    unanswered: int = 0
    cost_usd: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass
class GroupScore:
    group_id: str
    rubrics: pl.DataFrame
    verdicts_raw: pl.DataFrame
    verdicts: pl.DataFrame         # aggregated, with ``retained`` from the filter
    rewards: pl.DataFrame
    step_credit: pl.DataFrame
    token_advantages: pl.DataFrame
    calls: CallTally
    # the group's rollouts and steps as judged: a spot check asks the gold judge the same prompt
    inputs: tuple[pl.DataFrame, pl.DataFrame] | None = field(default=None, repr=False)


class _Tallied:
    """The client as the stages see it, counting this group's answers on the way through."""

    def __init__(self, client: LLMClient, tally: CallTally) -> None:
        self.client, self.tally = client, tally

    async def arun(self, requests: list[LLMRequest],
                   progress: Callable[[Progress], None] | None = None) -> list[list[Answer]]:
        answers = await self.client.arun(requests, progress=progress)
        t = self.tally
        for per_request in answers:
            for a in per_request:
                if a.status == "ok":
                    t.cached += a.cached
                    t.answered += not a.cached
                else:
                    t.unanswered += 1
                    reason = (a.reason or a.status).splitlines()[0][:120] if (
                        a.reason or a.status) else "?"
                    t.reasons[reason] = t.reasons.get(reason, 0) + 1
                t.cost_usd += a.cost_usd or 0.0
        return answers


class Scorer:
    """Scores groups concurrently under one call log, concurrency limit and deadline.

    ``model`` and the keywords of ``LLMSettings`` (``base_url``, ``concurrency``, ``rpm``,
    ``tpm``, ``timeout``, ``max_cost``, ``temperature``, ``seed``, …) say how to call the LLM;
    ``options`` are ``draco run``'s (setting, rubric, judge, credit); ``deadline`` is seconds
    per request. Use as ``async with``; the call log is opened once for every group.
    """

    def __init__(self, model: str, *, call_log: str | Path, options: RunOptions | None = None,
                 deadline: float | None = None, gold: LLMSettings | None = None,
                 gold_call_log: str | Path | None = None, **llm: Any) -> None:
        self.options = options or RunOptions()
        if self.options.rubric.kind == "none" and self.options.credit.reward != "outcome":
            raise UsageError("rubric kind none scores by --reward outcome only")
        if deadline is not None and deadline <= 0:
            raise UsageError(f"deadline {deadline!r}: must be > 0 seconds")
        try:
            self.llm = LLMSettings(model=model, **llm)
        except TypeError as exc:
            raise UsageError(f"Scorer: {exc}") from None
        self.call_log_path = Path(call_log)
        # the spot checks' gold judge: its own call log, never the reward's
        self.gold = gold
        self.gold_call_log_path = Path(gold_call_log) if gold_call_log is not None else \
            self.call_log_path.with_name(self.call_log_path.stem + ".spot_check.sqlite")
        self._gold_log: CallLog | None = None
        self.deadline = deadline
        p = self.options.prompt
        from draco_cli.llm.stage import render_options

        self.render = render_options(p)
        self.sampling = Sampling(max_tokens=p.max_tokens, thinking=self.llm.thinking)
        self._log: CallLog | None = None
        self._clients: dict[str, LLMClient] = {}
        self._sessions: list[AbstractAsyncContextManager[Any]] = []
        self.static_criteria = None
        if self.options.rubric.kind == "static":
            from draco_cli.rubric.core import load_static_rubric

            self.static_criteria = load_static_rubric(self.options.rubric.static_rubric)

    async def __aenter__(self) -> Scorer:
        self._log = CallLog(self.call_log_path).__enter__()
        self._clients["rubric"] = await self._open(self.llm, self._log)
        judge_model = self.options.judge.judge_model or self.llm.model
        self._clients["judge"] = (
            self._clients["rubric"] if judge_model == self.llm.model
            else await self._open(replace(self.llm, model=judge_model), self._log))
        if self.gold is not None:
            self._gold_log = CallLog(self.gold_call_log_path).__enter__()
            self._clients["gold"] = await self._open(self.gold, self._gold_log)
        return self

    async def _open(self, settings: LLMSettings, log: CallLog) -> Any:
        """A client of ``settings`` writing to ``log``, its session open until ``__aexit__``."""
        client = settings.client(log)
        client.deadline = self.deadline
        session = client.session()
        await session.__aenter__()
        self._sessions.append(session)
        return client

    async def __aexit__(self, *exc: Any) -> None:
        for session in reversed(self._sessions):
            await session.__aexit__(*exc)
        self._sessions.clear()
        for log in (self._log, self._gold_log):
            if log is not None:
                log.__exit__(*exc)
        self._log = self._gold_log = None

    @property
    def cost_usd(self) -> float:
        """Spent by calls made through this scorer (answers from the log cost nothing)."""
        return sum(c.spent for c in {id(c): c for c in self._clients.values()}.values())

    def flush_log(self) -> None:
        """Block until every answer so far is committed to the call log (a trainer killed
        after this pays for none of them again)."""
        for log in (self._log, self._gold_log):
            if log is not None:
                log.flush()

    async def score_group(self, rollouts: pl.DataFrame | pa.Table,
                          steps: pl.DataFrame | pa.Table) -> GroupScore:
        """Rubric, judge, filter, credit and token advantages of one group's rollouts."""
        if self._log is None:
            raise UsageError("Scorer.score_group: use the scorer inside `async with`")
        arrow = rollouts if isinstance(rollouts, pa.Table) else rollouts.to_arrow()
        spans = arrow.column("policy_spans") if "policy_spans" in arrow.column_names else None
        from draco_cli.io import as_frame, conform

        r = conform(as_frame(arrow.drop_columns(["policy_spans"]) if spans is not None
                             else arrow), Rollout, "rollouts",
                    [c for c in _ROLLOUT_COLUMNS if c in arrow.column_names or c in
                     ("rollout_id", "group_id", "task_id")])
        s = conform(steps if isinstance(steps, pl.DataFrame) else as_frame(steps), Step,
                    "steps", [c for c in _STEP_COLUMNS if c in steps.columns or c in
                              ("rollout_id", "step")])
        if not r.height:
            raise InputError("score_group: no rollouts", file="rollouts")
        if "outcome" not in r.columns:   # optional (SPEC §2): a group without one
            r = r.with_columns(pl.lit(None, dtype=pl.Float64).alias("outcome"))
        groups = r["group_id"].unique(maintain_order=True).to_list()
        if len(groups) != 1:
            raise InputError(f"score_group takes one group's rollouts, got {len(groups)} "
                             f"groups ({', '.join(map(str, groups[:3]))})", file="rollouts",
                             field="group_id")
        ours = s["rollout_id"].is_in(r["rollout_id"].implode())
        if not ours.all():
            at = int((~ours).arg_max() or 0)
            raise InputError(f"step of rollout {s['rollout_id'][at]!r}, which is not in group "
                             f"{groups[0]!r}: pass this group's steps only", file="steps",
                             row=at, field="rollout_id")
        if not s.height:
            raise InputError(f"no steps for any rollout of group {groups[0]!r}: pass the "
                             "group's steps (a rollout that acted has at least one)",
                             file="steps")
        if self.options.credit.reward == "outcome" and r["outcome"].null_count() == r.height:
            raise InputError(f"group {groups[0]!r}: --reward outcome needs the rollouts' "
                             "outcome, and none has one", file="rollouts", field="outcome")
        tally = CallTally()
        rubrics, raw, verdicts = await self._judge(r, s, tally)
        tables = await asyncio.to_thread(group_credit, r, s, verdicts, spans,
                                         self.options.credit)
        return GroupScore(groups[0], rubrics, raw, *tables, calls=tally, inputs=(r, s))

    async def spot_check(self, groups: list[GroupScore], n: int, seed: int,
                         train_step: int | None) -> pl.DataFrame:
        """N of these groups' verdicts (seeded by ``seed`` and ``train_step``) asked again of
        the gold judge (``judge.spot``); nothing here touches a reward."""
        from draco_cli.judge.spot import sample_verdicts, spot_stage

        if self.gold is None:
            raise UsageError("Scorer.spot_check: the scorer has no gold judge (spot_check_model)")
        judged = [g for g in groups if g.inputs is not None and g.verdicts.height]
        if not judged:
            return pl.DataFrame()
        r = pl.concat([g.inputs[0] for g in judged if g.inputs], how="diagonal_relaxed")
        s = pl.concat([g.inputs[1] for g in judged if g.inputs], how="diagonal_relaxed")
        verdicts = pl.concat([g.verdicts.drop("dropped_out", strict=False) for g in judged],
                             how="diagonal_relaxed")
        rubrics = pl.concat([g.rubrics for g in judged], how="diagonal_relaxed")
        sample = sample_verdicts(verdicts, r, n, seed, train_step)
        sampling = Sampling(max_tokens=self.options.prompt.max_tokens,
                            thinking=self.gold.thinking)
        return await adrive(spot_stage(sample, r, s, rubrics, gold_model=self.gold.model,
                                       seed=seed, train_step=train_step, sampling=sampling,
                                       render=self.render), self._clients["gold"])

    async def _judge(self, r: pl.DataFrame, s: pl.DataFrame, tally: CallTally
                     ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
        """(rubrics, raw verdicts, aggregated verdicts) of one group."""
        from draco_cli.judge.core import RAW_SCHEMA, score_stage
        from draco_cli.rubric.core import rubric_stage, static_rubrics

        o = self.options
        if o.rubric.kind == "none":
            empty = pl.DataFrame(schema=polars_schema(Rubric))
            raw = pl.DataFrame(schema=RAW_SCHEMA)
            return empty, raw, raw.drop("sample")
        if self.static_criteria is not None:   # rubric kind static
            rubrics = static_rubrics(r, self.static_criteria)
        else:
            # warm=False: groups finish one after another, so the task context is in the
            # cache from earlier groups; a lead round would lengthen each group's chain by a
            # call for the union's one cached rollout (docs/decisions.md)
            res = await adrive(rubric_stage(r, s, stages=("generate", "union", "merge"),
                                            max_criteria=o.rubric.max_criteria,
                                            render=self.render, sampling=self.sampling,
                                            warm=False),
                               _Tallied(self._clients["rubric"], tally))
            rubrics = res.rubrics
        scored = await adrive(score_stage(r, s, rubrics, samples=o.judge.samples,
                                          aggregate=o.judge.aggregate,
                                          judge=o.judge.judge_label, sampling=self.sampling,
                                          render=self.render),
                              _Tallied(self._clients["judge"], tally))
        return rubrics, scored.raw, scored.verdicts


def group_credit(r: pl.DataFrame, s: pl.DataFrame, verdicts: pl.DataFrame,
                 spans: pa.ChunkedArray[Any] | None, c: CreditOptions
                 ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(filtered verdicts, rewards, step credit, token advantages) of one group."""
    from draco_cli.credit import attach_groups, compute_credit, discriminative_filter, \
        narrow_judge
    from draco_cli.credit.tokens import token_form, token_spans
    from draco_cli.validate import policy_span_issues, raise_first

    if spans is not None:
        raise_first(policy_span_issues(spans, r["response_len"]), "rollouts", "policy_spans")
    v = verdicts.with_columns(pl.lit(None, dtype=pl.Boolean).alias("retained")) \
        if "retained" not in verdicts.columns else verdicts
    result = compute_credit(r, s, v.select("rollout_id", "criterion_id", "judge", "verdict",
                                           "cited_steps", "retained"),
                            verdicts_source="verdicts", steps_source="steps",
                            **c.credit_args())
    ta = token_spans(r, result.steps, result.step_credit["advantage"].to_numpy(),
                     result.rewards["advantage"].to_numpy(),
                     result.rewards["credit_mode"].to_numpy(), "steps", spans)
    ta = token_form(ta, c)
    filtered = verdicts
    if verdicts.height:
        filtered = discriminative_filter(
            attach_groups(narrow_judge(verdicts, c.judge), r, "verdicts"), c.drop
        ).drop("group_id", "__r", strict=False)
        if result.dropout is not None:   # what --rubric-dropout left out, as a column
            out = result.dropout.select("criterion_id", pl.lit(True).alias("dropped_out"))
            filtered = filtered.join(out, on="criterion_id", how="left", maintain_order="left"
                                     ).with_columns(pl.col("dropped_out").fill_null(False))
    return filtered, result.rewards, result.step_credit, ta
