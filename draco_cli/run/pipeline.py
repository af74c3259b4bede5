"""``draco run``: one training step, rubric → judge → filter → credit, into one run folder.
Stage keys, resume and the folder lock: see docs/run.md, "The run folder and its manifest".
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draco_cli import __version__
from draco_cli.errors import InputError, UsageError
from draco_cli.llm.settings import LLMSettings
from draco_cli.options import RunOptions
from draco_cli.prompts import CURRENT as PROMPT_VERSIONS
from draco_cli.llm.answered import Answered
from draco_cli.run import spot
from draco_cli.run.health import run_health, stage_figure
from draco_cli.io.files import file_sha256
from draco_cli.run.folder import Manifest, RunFolder, StageRecord, input_record
from draco_cli.run.inputs import check_model, check_train_step, row_count, run_dir_for

if TYPE_CHECKING:
    from draco_cli.llm.stage import StageReport

__all__ = ["RunOptions", "RunResult", "StageEvent", "run_step", "run_dir_for"]

LLM_PHASES = {"rubric": ["generate", "union", "merge"], "judge": ["score"]}


@dataclass
class StageEvent:
    """What a stage reports as it starts, ends or is reused (the command prints it)."""

    stage: str
    event: str                   # start | end | reused
    status: str = ""
    rows: int | None = None
    calls_new: int = 0
    calls_reused: int = 0
    cost_usd: float | None = 0.0  # None: unpriced
    priced: bool = True          # False: the model has no price, its cost says "unpriced"
    seconds: float = 0.0
    answered: Answered | None = None   # LLM stages: the stage's one answered figure
    reasons: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    run_dir: Path
    manifest: dict[str, Any]        # the manifest as JSON
    skipped: list[str]
    budget_reached: bool = False
    healthy: bool = True


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _contents(*paths: Path) -> list[str | None]:
    """SHA-256 of each file, None where absent: a stage keyed on these reruns exactly when
    what it reads changed."""
    return [file_sha256(p) if p.exists() else None for p in paths]


# rollouts per credit block inside ``draco run`` (see ``_Run._credit``)
RUN_CREDIT_BLOCK_ROLLOUTS = 1 << 14



def run_step(rollouts: Path, steps: Path, out: Path, llm: LLMSettings | None,
             opts: RunOptions | None = None, train_step: int | None = None,
             progress: Callable[[Any], None] | None = None,
             on_event: Callable[[StageEvent], None] | None = None, wait: bool = True,
             on_wait: Callable[[str], None] | None = None,
             gold: LLMSettings | None = None) -> RunResult:
    """Run one training step into ``out`` (or ``out/step-N`` with ``train_step``).

    ``llm`` may be None only for ``--setting outcome``, which makes no LLM call. ``on_event``
    hears each stage start and end; ``on_wait`` hears who holds the folder's lock when this
    run has to wait for it (``wait=False`` refuses instead). ``gold`` is the second judge of
    ``opts.spot_check`` (its answers go to RUN/spot_check_calls.sqlite, never to the reward).
    """
    opts = opts or RunOptions()
    if train_step is None:  # the run's step, however it was given
        train_step = opts.train_step if opts.train_step is not None else opts.credit.train_step
    run_dir = run_dir_for(Path(out), train_step)   # refuses a negative step
    # token advantages name the step where the rollouts do not
    opts = opts.model_copy(update={"credit": opts.credit.model_copy(
        update={"train_step": train_step})})
    if llm is not None and llm.batch is None:
        # a training step cannot wait hours for a batch: online unless --batch asks for it
        llm = replace(llm, batch=False)
    if opts.uses_llm and llm is None:
        raise UsageError(f"--model is required for --setting {opts.setting} (only --setting "
                         "outcome makes no LLM call)")
    for path in (rollouts, steps):
        if not Path(path).is_file():
            raise InputError("no such file", file=str(path))
    check_train_step(Path(rollouts), train_step)
    gold = spot.checked_gold(opts, gold)
    if llm is not None:  # a bad --judge-model must not wait until the rubric is paid for
        for model in {llm.model, opts.judge.judge_model or llm.model,
                      *([gold.model] if gold else [])}:
            check_model(model)
    static_criteria = None
    if opts.rubric.kind == "static":
        from draco_cli.rubric.core import load_static_rubric

        static_criteria = load_static_rubric(opts.rubric.static_rubric)  # refused up front
    folder = RunFolder(run_dir)
    with folder.lock(wait=wait, on_wait=on_wait):
        run = _Run(folder, Path(rollouts), Path(steps), llm, opts, train_step,
                   static_criteria, progress, on_event)
        run.gold = gold
        return run.run()


class _Run:
    def __init__(self, folder: RunFolder, rollouts: Path, steps: Path, llm: LLMSettings | None,
                 opts: RunOptions, train_step: int | None,
                 static_criteria: list[dict[str, str]] | None,
                 progress: Callable[[Any], None] | None,
                 on_event: Callable[[StageEvent], None] | None) -> None:
        self.folder, self.llm, self.opts, self.train_step = folder, llm, opts, train_step
        self.rollouts, self.steps = rollouts, steps
        self.static_criteria = static_criteria
        self.progress = progress
        self.on_event = on_event or (lambda e: None)
        self.old = folder.read_manifest() or Manifest()
        self.log = opts.call_log or folder.path / "llm_calls.sqlite"
        self.t0 = time.perf_counter()
        self.stages: dict[str, StageRecord] = {}
        self.skipped: list[str] = []
        self.forced = False
        self.inputs = {"rollouts": input_record(rollouts, folder.path),
                       "steps": input_record(steps, folder.path)}
        self.input_hashes = {k: v.sha256 for k, v in self.inputs.items()}
        self.gold: LLMSettings | None = None
        self.inputs_checked = False

    # -- the chain -------------------------------------------------------------------------

    def run(self) -> RunResult:
        from draco_cli.llm.stage import render_options

        opts = self.opts
        self.render = render_options(opts.prompt)
        run = self.folder.path
        self._same_inputs()
        try:
            if opts.rubric.kind != "none":
                rec = self._stage("rubric", self._rubric_key(), [self.folder.table("rubrics")],
                                  self._rubric)
                if rec.status == "budget reached":
                    return self._finish("budget reached")
                rec = self._stage("judge", self._judge_key(),
                                  [self.folder.table("verdicts"),
                                   self.folder.table("verdicts_raw")], self._judge)
                if rec.status == "budget reached":
                    return self._finish("budget reached")
            self._stage("credit", self._credit_key(),
                        [run / "credit" / f for f in ("rewards.parquet", "step_credit.parquet",
                                                      "token_advantages.parquet")],
                        self._credit)
            if self.gold is not None:   # after the credit: the reward never waits for it
                gold = self.gold
                # reruns when the inputs, the rubric, the training judge's verdicts, N, the
                # seed, the train step or the gold judge change
                key = _key("spot_check", self.input_hashes,
                           _contents(self.folder.table("rubrics"), self.folder.table("verdicts")),
                           self.opts.spot_check, self.opts.spot_check_seed, self.train_step,
                           self.opts.credit.drop, self._llm_key(gold))
                self._stage("spot_check", key, [self.folder.table("spot_checks")],
                            lambda: spot.stage(self.rollouts, self.steps, self.folder, gold,
                                               self.opts, self.train_step, self.render))
            else:   # a table of an earlier run's spot check would now be stale
                self.folder.table("spot_checks").unlink(missing_ok=True)
        except KeyboardInterrupt:
            self._fail("interrupted")
            raise
        except Exception as exc:
            # the manifest says the run failed and why, never "running" after the process ended
            self._fail("failed", str(exc).splitlines()[0][:500] if str(exc) else
                       type(exc).__name__)
            raise
        return self._finish(None)

    def _fail(self, status: str, error: str | None = None) -> None:
        for rec in self.stages.values():
            if rec.status == "running":
                rec.status = status
        manifest = self._manifest(status)
        if error is not None:
            from draco_cli.redact import redact

            manifest = manifest.model_copy(update={"error": redact(error)})
        self.folder.write_manifest(manifest)

    def _same_inputs(self) -> None:
        """A folder holding a run of other inputs is refused, or cleared with ``restart``: its
        tables would otherwise sit beside the new inputs' (the call log stays: its answers are
        keyed by request, reused where the requests are the same)."""
        old = {k: v.sha256 for k, v in self.old.inputs.items()}
        changed = [k for k in ("rollouts", "steps") if k in old and
                   old[k] != self.input_hashes[k]]
        if not changed:
            return
        if not self.opts.restart:
            was = self.old.inputs[changed[0]].path
            raise UsageError(f"-o {self.folder.path}: holds a run of other {changed[0]} ({was}); "
                             "use another folder, or --restart to clear this one's tables "
                             "(answers in its call log are kept and reused)")
        from draco_cli.run.folder import TABLES

        for rel in TABLES.values():
            (self.folder.path / rel).unlink(missing_ok=True)
        self.old = Manifest()

    def _stage(self, name: str, key: str, outputs: list[Path],
               body: Callable[[], StageRecord]) -> StageRecord:
        prev = self.old.stages.get(name)
        self.forced = self.forced or name in self.opts.redo
        if not self.forced and prev is not None and prev.key == key and \
                prev.status == "done" and all(p.exists() for p in outputs):
            self.stages[name] = prev
            self.skipped.append(name)
            self.on_event(StageEvent(name, "reused", status="done",
                                     rows=getattr(prev, "rows", None),
                                     seconds=prev.seconds or 0.0))
            return prev
        self.stages[name] = StageRecord(key=key, status="running")
        self._write("running")
        self.on_event(StageEvent(name, "start"))
        t = time.perf_counter()
        from draco_cli.llm.stage import log_position

        self._log_start = log_position(self.log)
        rec = body()
        rec.key = key
        rec.seconds = round(time.perf_counter() - t, 3)
        self.stages[name] = rec
        self._write("running")
        ev = getattr(rec, "calls", None) or {}
        health = getattr(rec, "health", None)
        self.on_event(StageEvent(name, "end", status=rec.status, rows=getattr(rec, "rows", None),
                                 calls_new=ev.get("calls_new", 0),
                                 calls_reused=ev.get("calls_reused", 0),
                                 cost_usd=ev.get("cost_usd", 0.0),
                                 priced=ev.get("priced", True), seconds=rec.seconds,
                                 answered=stage_figure(health),
                                 reasons=dict((health or {}).get("reasons", {})),
                                 notes=list(rec.notes)))
        return rec

    # -- keys: options + contents of what each stage reads ----------------------------------

    def _llm_key(self, llm: LLMSettings) -> dict[str, Any]:
        key = {"model": llm.model, "base_url": llm.base_url, "thinking": llm.thinking,
               "prompt": self.opts.prompt.model_dump(mode="json"),
               "prompt_versions": PROMPT_VERSIONS}
        # sampling settings change the answers (they are in the call cache key too); left out
        # when unset so that folders made before they existed keep their keys
        for name in ("temperature", "seed"):
            if getattr(llm, name, None) is not None:
                key[name] = getattr(llm, name)
        return key

    def _rubric_key(self) -> str:
        r = self.opts.rubric
        if r.kind == "static":
            return _key("rubric", self.input_hashes["rollouts"], "static", self.static_criteria)
        assert self.llm is not None
        return _key("rubric", self.input_hashes, "dynamic", r.max_criteria,
                    self._llm_key(self.llm))

    def _judge_llm(self) -> LLMSettings:
        assert self.llm is not None
        return replace(self.llm, model=self.opts.judge.judge_model or self.llm.model)

    def _judge_key(self) -> str:
        return _key("judge", self.input_hashes, _contents(self.folder.table("rubrics")),
                    self.opts.judge.model_dump(mode="json", exclude={"judge_model"}),
                    self._llm_key(self._judge_llm()))

    def _credit_key(self) -> str:
        verdicts = _contents(self.folder.table("verdicts")) if self.opts.rubric.kind != "none" \
            else None
        # dropout off: the key of a folder made before dropout existed, so it is reused
        off = {"rubric_dropout", "dropout_seed"} if self.opts.credit.rubric_dropout == 0 \
            else set()
        if self.opts.credit.train_step is None:
            off.add("train_step")
        return _key("credit", self.input_hashes, verdicts,
                    self.opts.credit.model_dump(mode="json", exclude=off))

    # -- the stages ------------------------------------------------------------------------

    def _rubric(self) -> StageRecord:
        from draco_cli.rubric import stage as st

        rubric_dir = self.folder.path / "rubric"
        if self.opts.rubric.kind == "static":
            n, groups, _ = st.rubric_static(self.rollouts, self.opts.rubric.static_rubric,
                                            rubric_dir, force=True)
            return StageRecord(key="", status="done", kind="static", criteria=n * groups,
                               rows=n * groups)
        assert self.llm is not None
        work = partial(st.rubric_generate, settings=self.llm,
                       stages=("generate", "union", "merge"),
                       max_criteria=self.opts.rubric.max_criteria, render=self.render,
                       max_tokens=self.opts.prompt.max_tokens, force=True)
        return self._llm_stage("rubric", work, kind="dynamic")

    def _judge(self) -> StageRecord:
        from draco_cli.judge import stage as judge_stage

        j = self.opts.judge
        work = partial(judge_stage.judge_score, rubrics=self.folder.table("rubrics"),
                       settings=self._judge_llm(), samples=j.samples, aggregate=j.aggregate,
                       judge_label=j.judge_label, render=self.render,
                       max_tokens=self.opts.prompt.max_tokens, force=True)
        return self._llm_stage("judge", work)

    def _llm_stage(self, name: str, work: partial[StageReport], **extra: Any) -> StageRecord:
        """An LLM stage into ``run/<name>``: here, or on the Ray cluster by partitions of
        whole groups (``--engine ray``)."""
        if not self.inputs_checked:   # what the credit stage would refuse, before any call
            from draco_cli.credit.compute import check_inputs

            check_inputs(self.rollouts, self.steps)
            self.inputs_checked = True
        if self.opts.engine == "ray":
            from draco_cli.run import ray_engine

            report = ray_engine.run_stage(name, self.rollouts, self.steps, self.folder.path,
                                          self.log, work, partitions=self.opts.partitions,
                                          address=self.opts.ray_address)
        else:
            report = work(self.rollouts, self.steps, out=self.folder.path / name,
                          call_log=self.log, progress=self.progress)
        return self._llm_record(name, report, **extra)

    def _llm_record(self, name: str, report: StageReport, **extra: Any) -> StageRecord:
        from draco_cli.llm.stage import unanswered_reasons

        phases = {p: s for p, s in report.phases.items() if p in LLM_PHASES[name]}
        reused = sum(s.cached for s in phases.values())
        new = sum(s.answered + s.unanswered for s in phases.values())
        unanswered = sum(s.unanswered for s in phases.values())
        skipped = sum(s.skipped for s in phases.values())
        reasons = unanswered_reasons(self.log, LLM_PHASES[name], self._log_start)
        if skipped:
            reasons["budget reached (--max-cost)"] = skipped
        figure = Answered.of(phases.values())
        health = {"requests": figure.requests, "answered": figure.answered, "reasons": reasons}
        status = "budget reached" if report.budget_reached else \
            "done" if unanswered == 0 and skipped == 0 else "partial"
        priced = all(s.priced for s in phases.values())
        return StageRecord(key="", status=status, notes=list(report.notes), rows=report.rows,
                           health=health,
                           calls={"calls_new": new, "calls_reused": reused,
                                  # unknown, not $0: the model is not in the price table
                                  "cost_usd": round(sum(s.cost_usd for s in phases.values()), 6)
                                  if priced else None,
                                  "priced": priced,
                                  "unanswered": unanswered + skipped}, **extra)

    def _credit(self) -> StageRecord:
        from draco_cli.credit import credit_compute

        verdicts = self.folder.table("verdicts") if self.opts.rubric.kind != "none" else None
        # by blocks of whole groups when large: memory set by the block, the same tables.
        # Smaller blocks than credit compute's own: this stage's peak stacks on what the LLM
        # stages left in the heap (at 100k rollouts, 320 against 359 MiB alone, 6% slower).
        stats = credit_compute(self.rollouts, self.steps, verdicts,
                               self.folder.path / "credit", options=self.opts.credit,
                               force=True, block_rollouts=RUN_CREDIT_BLOCK_ROLLOUTS)
        return StageRecord(key="", status="done", stats=asdict(stats), rows=stats.rollouts,
                           reward=self.opts.credit.reward)

    # -- the manifest ----------------------------------------------------------------------

    def _manifest(self, status: str) -> Manifest:
        from draco_cli.run.folder import TABLES

        counts = {}
        for rel in TABLES.values():
            p = self.folder.path / rel
            if p.exists() and not rel.startswith("audit/"):
                counts[rel] = row_count(p)
        settings: dict[str, Any] = {
            "setting": self.opts.setting,
            **self.opts.rubric.model_dump(mode="json", exclude={"kind", "stages"}),
            "rubric": self.opts.rubric.kind,
            **self.opts.prompt.model_dump(mode="json"),
            **self.opts.judge.model_dump(mode="json"),
            **self.opts.credit.model_dump(mode="json"),
            "min_answered": self.opts.min_answered,
            "call_log": str(Path(self.log).absolute()),
        }
        if self.gold is not None:
            settings.update(spot.settings(self.opts, self.gold, self.folder.path))
        if self.llm is not None:
            settings.update(model=self.llm.model, thinking=self.llm.thinking,
                            base_url=self.llm.base_url)
        ta = self.folder.path / "credit" / "token_advantages.parquet"
        calls = {}
        if Path(self.log).exists():
            from draco_cli.llm.export import read_totals

            calls = read_totals(self.log)
        return Manifest(
            draco_version=__version__, status=status, train_step=self.train_step,
            settings=settings,
            prompt_versions={k: f"{k}.{v}" for k, v in PROMPT_VERSIONS.items()},
            inputs=self.inputs, stages=self.stages, skipped_this_run=self.skipped, rows=counts,
            llm_calls=calls, wall_seconds=round(time.perf_counter() - self.t0, 3),
            updated_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            token_advantages=str(ta.absolute()) if ta.exists() else None,
            health=run_health(self.stages, self.opts) if any(
                getattr(r, "health", None) or getattr(r, "stats", None)
                for r in self.stages.values()) else None)

    def _write(self, status: str) -> Manifest:
        manifest = self._manifest(status)
        self.folder.write_manifest(manifest)
        return manifest

    def _finish(self, stopped: str | None) -> RunResult:
        health = run_health(self.stages, self.opts)
        if stopped:
            status = stopped
        elif not health.ok:
            status = "unhealthy"
        elif any(r.status != "done" for r in self.stages.values()):
            status = "partial"
        else:
            status = "done"
        manifest = self._write(status)
        return RunResult(self.folder.path, manifest.model_dump(mode="json"), self.skipped,
                         budget_reached=stopped == "budget reached", healthy=health.ok)
