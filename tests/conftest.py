from __future__ import annotations

import functools
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SHARED_DATA = Path(os.environ.get("DRACO_SHARED_DATA", REPO.parent / "shared" / "data"))
TAU = SHARED_DATA / "tau-bench" / "gpt-4o-airline-15tasks.json"
TAU2 = SHARED_DATA / "tau2-bench" / "gpt-4.1-airline-1trial.json"
TAU2_FT = SHARED_DATA / "tau2-bench" / "ft-gpt-4.1-sft-airline-1trial.json"
APB = SHARED_DATA / "agentprocessbench"
APB_HOTPOT = APB / "hotpotqa.jsonl"
APB_JUDGES = ("gpt-5.2", "deepseek-chat", "deepseek-reasoner")
SAMPLE = REPO / "sample_data" / "appworld_mini.jsonl"


# Ray Data's autoscaling coordinator gives up on a job after 10 of its 5 s requests time out,
# which a 2-core machine busy with CI's builds reached (the Ray engine tests then failed with
# "Failed to get allocated resources"). Read when Ray Data is imported; the local cluster's
# workers inherit it.
os.environ.setdefault("RAY_DATA_AUTOSCALING_COORDINATOR_REQUEST_GET_TIMEOUT_S", "30")

# Property tests draw a fifth of their examples in a maintainer's run of the README's command
# (a quick loop); `.ci/run` sets DRACO_THOROUGH=1 and every one draws them all.
THOROUGH = os.environ.get("DRACO_THOROUGH", "") not in ("", "0")


def examples(n: int) -> int:
    """Hypothesis ``max_examples`` for a property test written for ``n``."""
    return n if THOROUGH else max(20, n // 5)


MISSING_DATA = [p for p in (TAU, TAU2, TAU2_FT, APB_HOTPOT) if not p.exists()]
# A test reads the real logs when it or one of its fixtures names them.
_REAL_DATA = re.compile(r"\b(TAU|TAU2|TAU2_FT|SHARED_DATA|APB|APB_HOTPOT|tau_slice_tables)\b")


def pytest_configure(config):
    # The real logs are part of the test contract: CI lays ../shared/data beside the checkout,
    # and there a missing folder is an error. Elsewhere the tests that read them are skipped
    # and the unit tests run alone.
    if MISSING_DATA and os.environ.get("CI"):
        raise pytest.UsageError(f"real test data missing: {MISSING_DATA} "
                                "(expected ../shared/data or DRACO_SHARED_DATA)")


def _reads_real_logs(item) -> bool:
    return any(_REAL_DATA.search(src) for src in _sources(item))


# Marker `process`: a test that crosses a process boundary — a real subprocess (`draco` run as
# a user runs it, `process=True`), kill -9, two processes racing for a lock, a Ray cluster, a
# trainer's own code. These are most of the suite's wall time, so the README's `python -m
# pytest` leaves them out (pyproject.toml addopts: -m "not process and not llamacpp and not
# vllm") and `.ci/run` runs them after it (`-m process`, in parallel). Found from the test's own source,
# its fixtures' and the module's helpers it calls, so a new test of that kind is marked without
# a list to keep; `_PROCESS_TESTS` names the few that reach a process another way.
_PROCESS = re.compile(r"process=True|subprocess\.(run|Popen|check_call|check_output|call)\b|"
                      r"\bPopen\(|SIGKILL|os\.kill\(|\bray\.init\(|multiprocessing|"
                      r"engine=\"ray\"|\"--engine\", \"ray\"")
_RAY = re.compile(r"\bray\.init\(|engine=\"ray\"|\"--engine\", \"ray\"|engine_ray")
# whole modules: the Ray engine (a local cluster of worker processes) and the real servers
_PROCESS_MODULES = {"test_engine_ray.py", "test_llamacpp.py", "test_vllm.py"}
_PROCESS_TESTS: set[str] = set()  # "test_module.py::test_name" (parametrized ids included)


@functools.cache
def _source(func) -> str | None:
    """A function's source, read once per worker: parametrized tests and shared fixtures ask
    for the same functions again and again (uncached, ~2 s of every worker's collection)."""
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):  # builtins, fixtures without source
        return None


def _sources(item):
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)  # every fixture the test uses, transitively
    if info is not None:
        funcs += [d.func for defs in info.name2fixturedefs.values() for d in defs]
    return [src for src in map(_source, funcs) if src is not None]


def _crosses_a_process(item) -> bool:
    if any(item.get_closest_marker(m) for m in ("trainers", "llamacpp", "vllm")):
        return True
    if item.path.name in _PROCESS_MODULES or item.path.parent.name == "trainers":
        return True
    if f"{item.path.name}::{item.originalname}" in _PROCESS_TESTS:
        return True
    module = getattr(item, "module", None)
    helpers = {name: obj for name, obj in vars(module).items()
               if inspect.isfunction(obj) and obj.__module__ == module.__name__} if module else {}
    seen: set[str] = set()
    todo = list(_sources(item))
    while todo:  # the test, its fixtures, and the module's functions they call, transitively
        src = todo.pop()
        if _PROCESS.search(src):
            return True
        for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", src)) - seen:
            seen.add(name)
            if name in helpers and (src := _source(helpers[name])) is not None:
                todo.append(src)
    return False


# Folders and modules whose every test crosses a process, with the markers its tests carry:
# a run whose -m deselects all of them (the README's) does not import them — torch, the
# trainers and Ray cost each worker ~10 s of a two-minute run.
_ALL_PROCESS = {"trainers": [{"process"}, {"process", "trainers"}],
                "test_llamacpp.py": [{"process", "llamacpp"}],
                "test_vllm.py": [{"process", "vllm"}],
                "test_engine_ray.py": [{"process"}]}


def pytest_ignore_collect(collection_path, config):
    from _pytest.mark.expression import Expression

    kinds = _ALL_PROCESS.get(collection_path.name)
    expr = config.option.markexpr
    if kinds is None or not expr or collection_path.parent.name != "tests":
        return None
    selected = Expression.compile(expr)
    if not any(selected.evaluate(lambda name, k=k: name in k) for k in kinds):
        return True
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _crosses_a_process(item):
            item.add_marker(pytest.mark.process)
            # `.ci/run` spreads these over two workers by group (`--dist loadgroup`): a module's
            # tests stay on one worker (its module fixtures are built once), and every test
            # that starts a Ray cluster shares one worker (two clusters would race for ports).
            group = "ray" if any(_RAY.search(src) for src in _sources(item)) else item.path.name
            item.add_marker(pytest.mark.xdist_group(group))
    if not MISSING_DATA:
        return
    skip = pytest.mark.skip(reason=f"reads the real logs, missing here: {MISSING_DATA[0]} "
                                   "(set DRACO_SHARED_DATA)")
    for item in items:
        if _reads_real_logs(item):
            item.add_marker(skip)


def sample_step(n: int, into: Path) -> list[str]:
    """``--rollouts R --steps S`` of the sample as train step ``n``: its rollouts say step 0,
    and ``draco run --train-step n`` refuses rollouts that say another step, so for n > 0 a
    copy with ``train_step`` = n is written into ``into``."""
    sample = REPO / "sample_data" / "appworld_mini"
    rollouts = sample / "rollouts.parquet"
    if n:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rollouts = into / f"rollouts-step-{n}.parquet"
        if not rollouts.exists():
            into.mkdir(parents=True, exist_ok=True)
            table = pq.read_table(sample / "rollouts.parquet")
            i = table.schema.get_field_index("train_step")
            step = pa.array([n] * table.num_rows, table.schema.field(i).type)
            pq.write_table(table.set_column(i, table.schema.field(i), step), rollouts)
    return ["--rollouts", str(rollouts), "--steps", str(sample / "steps.parquet")]


def run_draco(*args: str, input: bytes | None = None, cwd: Path | None = None,
              process: bool = False) -> subprocess.CompletedProcess:
    """Run the real CLI's entry point (``draco_cli.cli.main``: parsing, the one error mapping,
    exit codes, stdout/stderr as bytes) on ``args``, as a user would.

    In this process by default: a fresh ``python -m draco_cli`` costs ~2 s of imports on a busy
    machine and proves nothing more for most tests. ``process=True`` (or DRACO_TEST_SUBPROCESS=1
    for the whole suite) runs a real subprocess where the process itself is the point."""
    if process or os.environ.get("DRACO_TEST_SUBPROCESS"):
        return subprocess.run([sys.executable, "-m", "draco_cli", *args], input=input,
                              capture_output=True, cwd=cwd or REPO)
    return _run_in_process([str(a) for a in args], input, cwd or REPO)


def _run_in_process(args: list[str], input: bytes | None, cwd: Path):
    import io

    from draco_cli import _allocator
    from draco_cli.cli import main

    out, err = io.BytesIO(), io.BytesIO()
    saved = (sys.argv, sys.stdin, sys.stdout, sys.stderr, os.getcwd(), _allocator.tune_allocator,
             _allocator.release_freed_memory)
    sys.argv = ["draco", *args]
    sys.stdin = io.TextIOWrapper(io.BytesIO(input or b""), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", write_through=True)
    # glibc tuning and handing freed memory back are per process, for a command's own lifetime;
    # not for pytest's (a full collection of pytest's heap took ~0.14 s a stage boundary: a
    # quarter of the suite's `draco run`s). Real processes (`process=True`) still do both.
    _allocator.tune_allocator = lambda *a, **k: False
    _allocator.release_freed_memory = lambda: None
    os.chdir(cwd)
    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"), as the interpreter reports it
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
        (sys.argv, sys.stdin, sys.stdout, sys.stderr, cwd_before, _allocator.tune_allocator,
         _allocator.release_freed_memory) = saved
        os.chdir(cwd_before)
    return subprocess.CompletedProcess(["draco", *args], code, stdout, stderr)


def tau_slice_tables(d: Path, pick) -> Path:
    """The real tau-bench sample ingested into ``d/all``, and the rollouts ``pick`` keeps from
    its rollouts table (with their steps) written to ``d``: the inputs of a real-server test."""
    import polars as pl

    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(d / "all")).returncode == 0
    keep = pick(pl.read_parquet(d / "all" / "rollouts.parquet"))
    pl.read_parquet(d / "all" / "steps.parquet").filter(
        pl.col("rollout_id").is_in(keep["rollout_id"].implode())).write_parquet(
        d / "steps.parquet")
    keep.write_parquet(d / "rollouts.parquet")
    return d


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def chat_row():
    """A minimal valid openai-jsonl rollout with token counts."""

    def make(**over):
        row = {
            "rollout_id": "r1",
            "task_id": "t1",
            "outcome": 1.0,
            "messages": [
                {"role": "system", "content": "sys", "n_tokens": 3},
                {"role": "user", "content": "do it", "n_tokens": 4},
                {"role": "assistant", "content": None, "n_tokens": 10,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42", "n_tokens": 5},
                {"role": "assistant", "content": "done", "n_tokens": 2},
            ],
        }
        row.update(over)
        return row

    return make
