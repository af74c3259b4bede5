"""Scoring inside the training step: ``StepScorer`` judges each group the moment its last rollout
finishes and hands back every rollout's per-token advantages by its id, with a counted fallback
for a group past its ``deadline``; ``BlockingStepScorer`` does the same for synchronous
trainers. See docs/inloop.md, "Inside the training step"."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Awaitable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import polars as pl

from draco_cli.errors import InputError, UsageError
from draco_cli.inloop.metrics import NoSignalWarning, signal_problem, step_metrics
from draco_cli.inloop.rows import Decode, Records, TrainerRollout, rollout_records, row_frames
from draco_cli.inloop.scorer import GroupScore, Scorer, group_credit
from draco_cli.options import CreditOptions, RunOptions

if TYPE_CHECKING:
    from draco_cli.llm.settings import LLMSettings

Fallback = Literal["outcome", "zero"]
T = TypeVar("T")
F = TypeVar("F", bound="asyncio.Future[Any]")


@dataclass(frozen=True)
class RowAdvantages:
    """One rollout's per-token advantages (float32, one per response token; observation
    tokens 0) and where they came from: ``draco`` or ``fallback:outcome``/``fallback:zero``."""

    rollout_id: str
    group_id: str
    values: np.ndarray
    source: str
    credit_mode: str


@dataclass
class StepResult:
    """Every rollout of one training step, scored: ``rows`` by rollout id, the step's
    ``metrics`` (``draco/…``, for the trainer's logger), the scored ``groups`` (for the audit
    files) and the groups that fell back, with the reason."""

    train_step: int | None
    rows: dict[str, RowAdvantages]
    metrics: dict[str, float]
    groups: list[GroupScore]
    fallbacks: dict[str, str] = field(default_factory=dict)
    # spot_check=N: the step's N sampled verdicts beside the gold judge's (never the reward)
    spot_checks: pl.DataFrame | None = None
    # what scored it (the judge model, the setting), for the step folder's manifest
    settings: dict[str, str] = field(default_factory=dict)

    def tables(self, names: Sequence[str] = ("rubrics", "verdicts_raw", "verdicts", "rewards",
                                              "step_credit", "token_advantages")
               ) -> dict[str, pl.DataFrame]:
        """The step's tables as ``draco run`` names them (scored groups only); ``names``: only
        those."""
        out: dict[str, pl.DataFrame] = {}
        for name in names:
            parts = [getattr(g, name) for g in self.groups if getattr(g, name).height]
            out[name] = pl.concat(parts, how="diagonal_relaxed") if parts else \
                pl.DataFrame()
        return out


@dataclass
class _Group:
    members: list[TrainerRollout] = field(default_factory=list)
    size: int | None = None    # its own size where the trainer gave one (``add``)
    complete_at: float | None = None
    task: asyncio.Task[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    score: GroupScore | None = None
    ready_at: float | None = None
    fallback: str | None = None
    error: InputError | None = None   # short of members when the step ended
    rows: dict[str, RowAdvantages] = field(default_factory=dict)   # once scored
    records: dict[str, Records] = field(default_factory=dict)      # each member's, decoded


@dataclass
class _Step:
    groups: dict[str, _Group] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)   # rollout id -> its group id
    last_finish: float = 0.0


class StepScorer:
    """Collects finished rollouts, scores each group once complete and hands back each
    rollout's advantages; arguments: docs/inloop.md, "Inside the training step" and "Spot
    checks and rubric dropout". ``request_deadline`` bounds each LLM request (``Scorer``'s
    ``deadline``; default: the group's ``deadline``); other keywords as ``Scorer``. A group's
    rollouts are scored in rollout-id order, whatever order they arrived in;
    ``rubric_dropout``/``spot_check`` arguments override ``options``'."""

    def __init__(self, model: str, *, call_log: str | Path, group_size: int,
                 decode: Decode, options: RunOptions | None = None,
                 deadline: float | None = None, fallback: Fallback = "outcome",
                 request_deadline: float | None = None, min_signal: float = 0.0,
                 rubric_dropout: float | None = None, dropout_seed: int | None = None,
                 spot_check: int | None = None, spot_check_seed: int | None = None,
                 spot_check_model: str | None = None,
                 spot_check_llm: Mapping[str, Any] | None = None,
                 spot_check_call_log: str | Path | None = None, **llm: Any) -> None:
        if group_size < 1:
            raise UsageError(f"group_size {group_size!r}: must be >= 1")
        if deadline is not None and deadline <= 0:
            raise UsageError(f"deadline {deadline!r}: must be > 0 seconds")
        if fallback not in ("outcome", "zero"):
            raise UsageError(f"fallback {fallback!r}: choose outcome or zero")
        if not 0.0 <= min_signal <= 1.0:
            raise UsageError(f"min_signal {min_signal!r}: a share between 0 and 1")
        self.group_size, self.deadline, self.fallback = group_size, deadline, fallback
        self.decode, self.min_signal = decode, min_signal
        self._said_no_signal = False
        options = _with_overrides(options or RunOptions(), rubric_dropout, dropout_seed,
                                  spot_check, spot_check_seed)
        gold = _gold(options, spot_check_model, spot_check_llm)
        self.spot_check, self.spot_check_seed = options.spot_check, options.spot_check_seed
        self.scorer = Scorer(model, call_log=call_log, options=options,
                             deadline=request_deadline or deadline, gold=gold,
                             gold_call_log=spot_check_call_log, **llm)
        self._steps: dict[int | None, _Step] = {}
        # every group's task and judging job still running, wherever its step went: closing
        # unwinds them before the client session they call through goes away
        self._running: set[asyncio.Future[Any]] = set()

    def _track(self, fut: F) -> F:
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)
        return fut

    async def __aenter__(self) -> StepScorer:
        await self.scorer.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        running = list(self._running)
        for fut in running:
            fut.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self.scorer.__aexit__(*exc)

    def _step(self, train_step: int | None) -> _Step:
        return self._steps.setdefault(train_step, _Step())

    def discard(self, train_step: int | None, groups: Collection[str] | None = None) -> None:
        """Forget a step's rollouts and stop judging its groups (a trainer whose generation
        failed part way and will generate the step again), or only ``groups`` of it (groups the
        trainer dropped). Answers already logged stay."""
        if groups is None:
            st = self._steps.pop(train_step, _Step())
        else:
            st = self._split(train_step, [g for g in groups
                                          if g in self._steps.get(train_step, _Step()).groups])
        for g in st.groups.values():
            if g.task is not None:
                g.task.cancel()

    async def add(self, rollout: TrainerRollout, group_size: int | None = None) -> None:
        """A rollout finished: record it; its group starts scoring once it has ``group_size``
        (``group_size`` here: this group's own size, for a trainer that drops failed members)."""
        size = self.group_size if group_size is None else group_size
        if size < 1:
            raise UsageError(f"group_size {group_size!r}: must be >= 1")
        st = self._step(rollout.train_step)
        if rollout.rollout_id in st.seen:
            raise InputError(f"{rollout.where()}: rollout id given twice in step "
                             f"{rollout.train_step}", field="rollout_id")
        # checked now, named by its trainer row, and decoded once (the group's tables reuse it)
        records = rollout_records(rollout, self.decode)
        st.seen[rollout.rollout_id] = rollout.group_id
        now = time.monotonic()
        st.last_finish = max(st.last_finish, now)
        g = st.groups.setdefault(rollout.group_id, _Group())
        if g.complete_at is not None:
            raise InputError(f"{rollout.where()}: group already has its {len(g.members)} "
                             "rollouts (group_size)", field="group_id")
        g.members.append(rollout)
        g.records[rollout.rollout_id] = records
        g.size = size
        if len(g.members) == size:
            g.complete_at = now
            g.task = self._track(asyncio.create_task(self._score(st, rollout.group_id, g)))

    async def _score(self, st: _Step, group_id: str, g: _Group) -> None:
        try:
            # rollout-id order, not arrival order: the union prompt lists the group's attempts,
            # and sessions finish in another order every run (a restart would pay again)
            r, s = row_frames([g.records.pop(m.rollout_id)   # the frames hold them now
                               for m in sorted(g.members, key=lambda m: m.rollout_id)])
            job = self._track(asyncio.ensure_future(self.scorer.score_group(r, s)))
            try:
                g.score = await asyncio.wait_for(asyncio.shield(job), self.deadline)
            except TimeoutError:
                job.cancel()
                g.fallback = f"no advantages within the deadline ({self.deadline:g} s)"
            except asyncio.CancelledError:
                job.cancel()    # the shield kept it from hearing
                raise
            # the fallback's credit computed off the event loop the trainer's sessions share
            rows = self._rows(g.score.token_advantages, g.score.rewards, "draco") \
                if g.score is not None else await asyncio.to_thread(self._fallback_rows, r, s)
            g.rows = {k: RowAdvantages(k, group_id, *v) for k, v in rows.items()}
            g.ready_at = time.monotonic()
        finally:
            g.done.set()

    def _rows(self, ta: pl.DataFrame, rewards: pl.DataFrame, source: str
              ) -> dict[str, tuple[np.ndarray, str, str]]:
        from draco_cli.credit.tokens import spans_to_dense

        dense = ta if "advantages" in ta.columns else spans_to_dense(ta)
        modes = dict(zip(rewards["rollout_id"].to_list(), rewards["credit_mode"].to_list()))
        return {rid: (np.asarray(vals, dtype=np.float32), source, str(modes.get(rid, "")))
                for rid, vals in zip(dense["rollout_id"].to_list(),
                                     dense["advantages"].to_list())}

    def _fallback_rows(self, r: pl.DataFrame, s: pl.DataFrame
                       ) -> dict[str, tuple[np.ndarray, str, str]]:
        from draco_cli.credit.tables import no_verdicts

        source = f"fallback:{self.fallback}"
        if self.fallback == "zero" or r["outcome"].null_count() == r.height:
            return {rid: (np.zeros(n, dtype=np.float32), source, "none")
                    for rid, n in zip(r["rollout_id"].to_list(), r["response_len"].to_list())}
        spans = r.select("policy_spans").to_arrow().column(0)
        _, rewards, _, ta = group_credit(r.drop("policy_spans"), s, no_verdicts(), spans,
                                         CreditOptions(reward="outcome", credit="uniform",
                                                       tokens="dense"))
        return self._rows(ta, rewards, source)

    async def advantages(self, rollout_id: str, train_step: int | None = None) -> RowAdvantages:
        """The rollout's advantages once its group is complete and scored (or has fallen back);
        an error if the step ends with its group short of members."""
        st = self._steps.get(train_step)
        if st is None or rollout_id not in st.seen:
            raise InputError(f"rollout {rollout_id!r}: not added in step {train_step}",
                             field="rollout_id")
        g = st.groups[st.seen[rollout_id]]
        await g.done.wait()    # the group completes (or the step ends short of it)
        if g.error is not None:
            raise g.error
        if g.task is not None and g.task.done() and g.task.exception() is not None:
            raise g.task.exception()  # type: ignore[misc]
        return g.rows[rollout_id]

    async def finish(self, train_step: int | None = None,
                     groups: Collection[str] | None = None) -> StepResult:
        """Every group of the step scored (or fallen back); the step's rows and metrics. A group
        short of ``group_size`` rollouts is an error naming it. ``groups`` finishes only those
        groups of the step (an async trainer's batch holds part of a generation step), the
        others staying pending; a group id the step has not seen is an error."""
        st = self._steps.pop(train_step, _Step()) if groups is None else \
            self._split(train_step, groups)
        short = [(gid, g) for gid, g in st.groups.items() if g.complete_at is None]
        for gid, g in short:
            have = ", ".join(m.rollout_id + ("" if m.row is None else f" (trainer row {m.row})")
                             for m in g.members)
            g.error = InputError(
                f"group {gid!r}: {len(g.members)} of {g.size or self.group_size} rollouts "
                f"finished by the end of step {train_step} ({len(short)} groups short; "
                f"rollouts: {have})", field="group_id")
            g.done.set()    # a session waiting on it hears the error
        if short:
            for g in st.groups.values():
                if g.task is not None:
                    g.task.cancel()
            raise short[0][1].error  # type: ignore[misc]
        for g in st.groups.values():
            assert g.task is not None
            await g.task      # raises a group's input error
        rows = {k: v for g in st.groups.values() for k, v in g.rows.items()}
        ready = [g.ready_at for g in st.groups.values() if g.ready_at is not None]
        latency = max(0.0, max(ready) - st.last_finish) if ready else 0.0
        scored = [g.score for g in st.groups.values() if g.score is not None]
        fallbacks = {gid: g.fallback for gid, g in st.groups.items() if g.fallback}
        metrics = step_metrics(scored, rows, fallbacks, latency, self.min_signal)
        if not metrics["draco/signal_ok"] and not self._said_no_signal:
            # a trainer's logger may not show draco/signal_ok: said once, as a warning
            self._said_no_signal = True
            warnings.warn(f"draco: train step {train_step}: "
                          f"{signal_problem(metrics, self.min_signal)} (draco/signal_ok is 0; "
                          "said once per scorer)", NoSignalWarning, stacklevel=2)
        spot = None
        if self.spot_check and scored:
            spot = await self.scorer.spot_check(scored, self.spot_check, self.spot_check_seed,
                                                train_step)
            answered = spot["agree"].drop_nulls() if spot.height else pl.Series([], dtype=pl.Boolean)
            metrics["draco/spot_check_n"] = float(answered.len())
            if answered.len():
                metrics["draco/spot_check_agreement"] = float(answered.sum()) / answered.len()
        # the step's answers on disk before the trainer uses them: a kill after this step pays
        # for none of them again on restart
        await asyncio.to_thread(self.scorer.flush_log)
        return StepResult(train_step, rows, metrics, scored, fallbacks, spot,
                          {"setting": self.scorer.options.setting,
                           "model": self.scorer.llm.model})

    def _split(self, train_step: int | None, groups: Collection[str]) -> _Step:
        whole = self._steps.get(train_step, _Step())
        unknown = sorted(g for g in set(groups) if g not in whole.groups)
        if unknown:
            raise InputError(f"group {unknown[0]!r}: no rollout of it was added in step "
                             f"{train_step} ({len(unknown)} unknown groups)", field="group_id")
        part = _Step()
        for gid in dict.fromkeys(groups):
            g = part.groups[gid] = whole.groups.pop(gid)
            for m in g.members:
                part.seen[m.rollout_id] = whole.seen.pop(m.rollout_id)
            if g.complete_at is not None:
                part.last_finish = max(part.last_finish, g.complete_at)
        if not whole.groups:
            self._steps.pop(train_step, None)
        return part

    async def score_step(self, rollouts: Sequence[TrainerRollout],
                         train_step: int | None = None) -> StepResult:
        """A batch that finished together: every group scored concurrently."""
        steps = {r.train_step for r in rollouts}
        if steps - {train_step}:
            raise InputError(f"score_step({train_step}): rollouts claim train steps "
                             f"{sorted(map(str, steps))}", field="train_step")
        for r in rollouts:
            await self.add(r)
        return await self.finish(train_step)


def _with_overrides(options: RunOptions, rubric_dropout: float | None,
                    dropout_seed: int | None, spot_check: int | None,
                    spot_check_seed: int | None) -> RunOptions:
    credit = {k: v for k, v in (("rubric_dropout", rubric_dropout),
                                ("dropout_seed", dropout_seed)) if v is not None}
    run = {k: v for k, v in (("spot_check", spot_check), ("spot_check_seed", spot_check_seed))
           if v is not None}
    if not credit and not run:
        return options
    return RunOptions.build(**{**options.model_dump(), **run,
                               "credit": {**options.credit.model_dump(), **credit}})


def _gold(options: RunOptions, model: str | None, llm: Mapping[str, Any] | None
          ) -> LLMSettings | None:
    from draco_cli.llm.settings import LLMSettings

    if (options.spot_check > 0) != (model is not None):
        raise UsageError("spot_check=N needs spot_check_model, and spot_check_model needs "
                         "spot_check=N with N > 0")
    if model is None:
        return None
    try:
        return LLMSettings(model=model, **dict(llm or {}))
    except TypeError as exc:
        raise UsageError(f"spot_check_llm: {exc}") from None


class BlockingStepScorer:
    """A ``StepScorer`` on an event loop of its own thread, for synchronous trainers: the same
    arguments; ``score_step`` blocks; ``close`` (or ``with``) ends it."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="draco-step-scorer")
        self._thread.start()
        try:
            self.inner = self._call(StepScorer(model, **kwargs).__aenter__())
        except BaseException:
            self._stop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
        async def run() -> T:
            return await coro
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def score_step(self, rollouts: Sequence[TrainerRollout],
                   train_step: int | None = None) -> StepResult:
        return self._call(self.inner.score_step(rollouts, train_step))

    def add(self, rollout: TrainerRollout, group_size: int | None = None) -> None:
        """``StepScorer.add``: returns once recorded; a complete group is judged on the
        scorer's own thread meanwhile."""
        self._call(self.inner.add(rollout, group_size))

    def discard(self, train_step: int | None, groups: Collection[str] | None = None) -> None:
        self._loop.call_soon_threadsafe(self.inner.discard, train_step, groups)

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.inner.__aexit__(None, None, None))
        finally:
            self._stop()

    def __enter__(self) -> BlockingStepScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
