"""The LLM stages run in chunks of groups (``ops/llmstage.py``) write exactly the tables one
pass over all rollouts writes: same rows in the same order, same calls, nothing paid twice on
a rerun. Inputs shuffled so that a group's rollouts are not next to each other."""

from __future__ import annotations

import polars as pl
import pytest

from draco_cli.io.tables import _to_arrow
from draco_cli.judge.core import score_stage
from draco_cli.llm.calllog import CallLog
from draco_cli.llm.drive import drive
from draco_cli.llm.settings import LLMSettings
from draco_cli.llm.types import Sampling
from draco_cli.judge.stage import judge_score
from draco_cli.llm.stage import render_options
from draco_cli.options import PromptOptions
from draco_cli.rubric.stage import rubric_generate
from draco_cli.rubric.core import rubric_stage
from draco_cli.schemas import Rubric, RubricCandidate, VerdictAggregated, VerdictRaw
from tests.conftest import TAU, run_draco
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import KEY, scripted

STAGES = ("generate", "union", "merge")


def written(df: pl.DataFrame, model) -> pl.DataFrame:
    """A frame as the whole-table writer put it in its file (contract columns, in order)."""
    return pl.from_arrow(_to_arrow(df, model))


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory):
    d = tmp_path_factory.mktemp("tau")
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(d)).returncode == 0
    for name in ("rollouts", "steps"):
        df = pl.read_parquet(d / f"{name}.parquet")
        df.sample(fraction=1.0, shuffle=True, seed=7).write_parquet(d / f"{name}.parquet")
    r = pl.read_parquet(d / "rollouts.parquet")
    assert r["group_id"].n_unique() > 5 and not r["group_id"].is_sorted()
    return d


def test_chunked_stages_write_what_one_pass_writes(server, shuffled, tmp_path):
    r_path, s_path = shuffled / "rollouts.parquet", shuffled / "steps.parquet"
    settings = LLMSettings("openai/judge-model", base_url=server.url + "/v1", concurrency=8)
    render = render_options(PromptOptions(max_prompt_tokens=6000))
    rollouts, steps = pl.read_parquet(r_path), pl.read_parquet(s_path)

    # one pass over everything: the library stages as they were driven before chunking
    with CallLog(tmp_path / "whole.sqlite") as log:
        whole = drive(rubric_stage(rollouts, steps, stages=STAGES, max_criteria=4,
                                   render=render, sampling=Sampling()), settings.client(log))
        scored = drive(score_stage(rollouts, steps, whole.rubrics, samples=2, render=render,
                                   sampling=Sampling()), settings.client(log))
    calls_whole = server.hits["chat"]

    # chunks of ~7 rollouts (groups of 4: several groups per chunk, never split), two in flight
    out = tmp_path / "run"
    report = rubric_generate(r_path, s_path, out / "rubric", settings, stages=STAGES,
                             max_criteria=4, render=render, call_log=out / "calls.sqlite",
                             chunk_rollouts=7)
    assert pl.read_parquet(out / "rubric" / "rubrics.parquet").equals(
        written(whole.rubrics, Rubric))
    assert pl.read_parquet(out / "rubric" / "rubric_candidates.parquet").equals(
        written(whole.candidates, RubricCandidate))
    assert report.rows == whole.rubrics.height
    judged = judge_score(r_path, s_path, out / "rubric" / "rubrics.parquet", out / "judge",
                         settings, samples=2, aggregate="all", judge_label="judge",
                         render=render, call_log=out / "calls.sqlite", chunk_rollouts=5)
    assert pl.read_parquet(out / "judge" / "verdicts_raw.parquet").equals(
        written(scored.raw, VerdictRaw))
    assert pl.read_parquet(out / "judge" / "verdicts.parquet").equals(
        written(scored.verdicts, VerdictAggregated))
    assert judged.rows == scored.verdicts.height
    from draco_cli.llm.answered import Answered

    # one request per (rollout, sample), every one answered, chunked or not
    figure = Answered.of(judged.phases.values())
    assert figure.answered == figure.requests == scored.raw.select("rollout_id", "sample") \
        .n_unique()
    # the same calls, none more
    assert server.hits["chat"] - calls_whole == calls_whole

    # a rerun answers every call from the log
    before = server.hits["chat"]
    again = judge_score(r_path, s_path, out / "rubric" / "rubrics.parquet", out / "judge2",
                        settings, samples=2, aggregate="all", judge_label="judge",
                        render=render, call_log=out / "calls.sqlite", chunk_rollouts=3)
    assert server.hits["chat"] == before
    assert again.phases["score"].cached == rollouts.height * 2
    assert again.phases["score"].answered == 0
    assert pl.read_parquet(out / "judge2" / "verdicts.parquet").equals(
        written(scored.verdicts, VerdictAggregated))


def test_budget_reached_in_a_chunk_publishes_nothing(server, shuffled, tmp_path):
    settings = LLMSettings("openai/gpt-4.1", base_url=server.url + "/v1", concurrency=2,
                           max_cost=1e-9)
    render = render_options(PromptOptions(max_prompt_tokens=6000))
    report = rubric_generate(shuffled / "rollouts.parquet", shuffled / "steps.parquet",
                             tmp_path / "rubric", settings, stages=STAGES, max_criteria=4,
                             render=render, chunk_rollouts=5)
    assert report.budget_reached
    assert not (tmp_path / "rubric" / "rubrics.parquet").exists()
    assert not (tmp_path / "rubric" / "rubric_candidates.parquet").exists()
    assert not list((tmp_path / "rubric").glob(".draco-staging-*"))


def test_the_answer_cache_reads_the_log_as_the_dict_did(tmp_path):
    """``CallLog.answered()`` looks answers up on demand: the last answered row of a hash, only
    rows logged before it was opened, misses (hex or not) None, the export unchanged."""
    from draco_cli.llm.export import export_parquet

    h1, h2 = "ab" * 32, "cd" * 32
    with CallLog(tmp_path / "calls.sqlite") as log:
        log.record(request_hash=h1, sample=0, phase="score", status="ok", answer_text="first",
                   parsed="{}")
        log.record(request_hash=h1, sample=0, phase="score", status="ok", answer_text="last",
                   parsed="{}")
        log.record(request_hash=h1, sample=1, phase="score", status="unanswered")
        log.record(request_hash="not-hex", sample=0, phase="union", status="ok",
                   answer_text="plain", parsed="{}")
        cache = log.answered()
        log.record(request_hash=h2, sample=0, phase="score", status="ok", answer_text="later",
                   parsed="{}")
        log.flush()
        assert cache.get((h1, 0)).answer_text == "last"
        assert cache.get((h1, 1)) is None                 # unanswered is no answer
        assert cache.get(("not-hex", 0)).answer_text == "plain"
        assert cache.get((h2, 0)) is None                 # logged after the cache was opened
        assert log.answered().get((h2, 0)).answer_text == "later"
    n = export_parquet(tmp_path / "calls.sqlite", tmp_path / "calls.parquet")
    df = pl.read_parquet(tmp_path / "calls.parquet")
    assert n == df.height == 5
    assert df["answer_text"].to_list() == ["first", "last", None, "plain", "later"]
    assert df.schema["error"] == pl.Null and df.schema["sample"] == pl.Int64
