"""``draco run``: one training step, rubric → judge → filter → credit, into one run folder.

Every stage writes its tables into the run folder and the run's manifest records, per stage,
a hash of its inputs and settings. A rerun skips finished stages whose inputs are unchanged
and resumes unfinished LLM stages from the shared call log, so a finished run reruns in
seconds with zero calls, and a killed one continues where it stopped.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draco_cli import __version__
from draco_cli.errors import UsageError
from draco_cli.io import write_text_atomic
from draco_cli.llm.settings import LLMSettings
from draco_cli.prompts import CURRENT as PROMPT_VERSIONS

SETTINGS = {
    # name: (rubric, credit)  — the four settings of the DRACO paper (SPEC §3.7)
    "draco": ("dynamic", "step"),
    "no-credit": ("dynamic", "uniform"),
    "static": ("static", "step"),
    "static-no-credit": ("static", "uniform"),
}


@dataclass
class RunOptions:
    setting: str = "draco"
    judge_model: str | None = None
    samples: int = 1
    aggregate: str = "all"
    judge_label: str = "judge"
    max_criteria: int = 8
    static_rubric: str | None = None
    estimator: str = "grpo"
    std: str = "sample"
    drop: str = "all-pass"
    tokens: str = "spans"
    max_tokens: int = 4096
    max_prompt_tokens: int = 24000
    redact: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    run_dir: Path
    manifest: dict
    skipped: list[str]
    budget_reached: bool = False


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _stage_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def run_dir_for(out: Path, train_step: int | None) -> Path:
    return out / f"step-{train_step}" if train_step is not None else out


def run_step(rollouts: Path, steps: Path, out: Path, llm: LLMSettings, opts: RunOptions,
             train_step: int | None = None, progress=None) -> RunResult:
    from draco_cli import stages as st
    from draco_cli.pipeline import credit_compute

    if opts.setting not in SETTINGS:
        raise UsageError(f"--setting {opts.setting!r}: choose {', '.join(SETTINGS)}")
    rubric_kind, credit_kind = SETTINGS[opts.setting]
    for path in (rollouts, steps):
        if not Path(path).is_file():
            from draco_cli.errors import InputError

            raise InputError("no such file", file=str(path))
    run = run_dir_for(out, train_step)
    run.mkdir(parents=True, exist_ok=True)
    manifest_path = run / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    old_stages = old.get("stages", {})
    log = run / "llm_calls.sqlite"
    render = st.render_options(opts.max_prompt_tokens, opts.redact, False)
    t0 = time.perf_counter()
    inputs = {"rollouts": {"path": str(rollouts), "sha256": _file_hash(rollouts)},
              "steps": {"path": str(steps), "sha256": _file_hash(steps)}}
    stages: dict[str, dict] = {}
    skipped: list[str] = []
    phases: dict = {}

    def fresh(name: str, key: str, outputs: list[Path]) -> bool:
        prev = old_stages.get(name, {})
        if prev.get("key") == key and prev.get("status") == "done" and \
                all(p.exists() for p in outputs):
            stages[name] = prev
            skipped.append(name)
            return True
        return False

    # 1. rubric
    rubric_dir = run / "rubric"
    rubrics = rubric_dir / "rubrics.parquet"
    rkey = _stage_key(inputs, rubric_kind, opts.max_criteria, opts.static_rubric, llm.model,
                      opts.max_tokens, opts.max_prompt_tokens, opts.redact, llm.thinking,
                      PROMPT_VERSIONS)
    if not fresh("rubric", rkey, [rubrics]):
        t = time.perf_counter()
        if rubric_kind == "static":
            n, groups, _ = st.rubric_static(rollouts, Path(opts.static_rubric) if
                                            opts.static_rubric else None, rubric_dir, force=True)
            stages["rubric"] = {"key": rkey, "status": "done", "kind": "static",
                                "criteria": n * groups}
        else:
            report = st.rubric_generate(rollouts, steps, rubric_dir, llm,
                                        stages=("generate", "union", "merge"),
                                        max_criteria=opts.max_criteria, render=render,
                                        max_tokens=opts.max_tokens, call_log=log, force=True,
                                        progress=progress)
            phases.update(report.phases)
            if report.budget_reached:
                return _stop(run, manifest_path, old, inputs, stages, phases, opts, llm,
                             train_step, t0, skipped)
            stages["rubric"] = {"key": rkey, "status": "done", "kind": "dynamic",
                                "notes": report.notes}
        stages["rubric"]["seconds"] = round(time.perf_counter() - t, 3)

    # 2. judge
    judge_dir = run / "judge"
    verdicts = judge_dir / "verdicts.parquet"
    judge_llm = LLMSettings(**{**asdict(llm), "model": opts.judge_model or llm.model})
    jkey = _stage_key(inputs, stages["rubric"]["key"], judge_llm.model, opts.samples,
                      opts.aggregate, opts.judge_label, opts.max_tokens, opts.max_prompt_tokens,
                      opts.redact, judge_llm.thinking, PROMPT_VERSIONS)
    if not fresh("judge", jkey, [verdicts, judge_dir / "verdicts_raw.parquet"]):
        t = time.perf_counter()
        report = st.judge_score(rollouts, steps, rubrics, judge_dir, judge_llm,
                                samples=opts.samples, aggregate=opts.aggregate,
                                judge_label=opts.judge_label, render=render,
                                max_tokens=opts.max_tokens, call_log=log, force=True,
                                progress=progress)
        for k, v in report.phases.items():
            phases[k] = v
        if report.budget_reached:
            return _stop(run, manifest_path, old, inputs, stages, phases, opts, llm, train_step,
                         t0, skipped)
        stages["judge"] = {"key": jkey, "status": "done", "notes": report.notes,
                           "seconds": round(time.perf_counter() - t, 3)}

    # 3. filter + credit
    credit_dir = run / "credit"
    ckey = _stage_key(inputs, stages["judge"]["key"], credit_kind, opts.estimator, opts.std,
                      opts.drop, opts.tokens)
    outs = [credit_dir / f for f in ("rewards.parquet", "step_credit.parquet",
                                     "token_advantages.parquet")]
    if not fresh("credit", ckey, outs):
        t = time.perf_counter()
        stats = credit_compute(rollouts, steps, verdicts, credit_dir, credit=credit_kind,
                               estimator=opts.estimator, std=opts.std, drop=opts.drop,
                               tokens=opts.tokens, force=True)
        stages["credit"] = {"key": ckey, "status": "done", "stats": asdict(stats),
                            "seconds": round(time.perf_counter() - t, 3)}
    manifest = _manifest(run, old, inputs, stages, phases, opts, llm, train_step, t0, skipped,
                         status="done")
    write_text_atomic(manifest_path, json.dumps(manifest, indent=2, default=str) + "\n",
                      force=True)
    return RunResult(run, manifest, skipped)


def _calls_summary(run: Path) -> dict:
    log = run / "llm_calls.sqlite"
    if not log.exists():
        return {}
    from draco_cli.llm.calllog import read_totals

    return read_totals(log)


def _manifest(run, old, inputs, stages, phases, opts, llm, train_step, t0, skipped, status):
    from draco_cli.io import read_arrow

    counts = {}
    for rel in ("rubric/rubrics.parquet", "rubric/rubric_candidates.parquet",
                "judge/verdicts_raw.parquet", "judge/verdicts.parquet",
                "credit/rewards.parquet", "credit/step_credit.parquet",
                "credit/token_advantages.parquet"):
        p = run / rel
        if p.exists():
            counts[rel] = read_arrow(p).num_rows
    settings = asdict(opts)
    settings["model"] = llm.model
    settings["thinking"] = llm.thinking
    settings["base_url"] = llm.base_url
    return {
        "draco_version": __version__,
        "status": status,
        "train_step": train_step,
        "settings": settings,
        "prompt_versions": {k: f"{k}.{v}" for k, v in PROMPT_VERSIONS.items()},
        "inputs": inputs,
        "stages": stages,
        "skipped_this_run": skipped,
        "rows": counts,
        "llm_calls": _calls_summary(run),
        "wall_seconds": round(time.perf_counter() - t0, 3),
        "updated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "token_advantages": str(run / "credit" / "token_advantages.parquet"),
    }


def _stop(run, manifest_path, old, inputs, stages, phases, opts, llm, train_step, t0, skipped):
    manifest = _manifest(run, old, inputs, stages, phases, opts, llm, train_step, t0, skipped,
                         status="budget reached")
    write_text_atomic(manifest_path, json.dumps(manifest, indent=2, default=str) + "\n",
                      force=True)
    return RunResult(run, manifest, skipped, budget_reached=True)
