"""The LLM layer against a local server speaking the OpenAI and Anthropic protocols, through
the real SDK clients. No network: everything goes to 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Literal

import polars as pl
import pytest
from pydantic import BaseModel

from draco_cli.llm.export import read_totals
from draco_cli.llm import CallLog, LLMClient, LLMError, LLMRequest, PriceTable, ReplayMiss, \
    Sampling, export_parquet
from tests.conftest import REPO
from tests.llm_server import FakeLLMServer

PLANTED = "sk-test-PLANTEDsecretKEY-0123456789abcdef"


class Judgement(BaseModel):
    verdict: Literal["pass", "fail"]
    steps: list[int]
    reason: str


PRICES = PriceTable({"models": {
    "openai/test-model": {"input": 1.0, "cached_input": 0.5, "output": 2.0},
    "anthropic/test-claude": {"input": 3.0, "cached_input": 0.3, "cache_write": 3.75,
                              "output": 15.0}}}, "test")


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    s = FakeLLMServer().start()
    yield s
    s.stop()


def req(key="r1", samples=1, phase="score", **kw) -> LLMRequest:
    return LLMRequest(phase=phase, key=key, samples=samples, answer_model=Judgement,
                      messages=[{"role": "system", "content": "You judge."},
                                {"role": "user", "content": f"Judge rollout {key}."}],
                      template_version="t1", **kw)


def client(server, log, model="openai/test-model", **kw) -> LLMClient:
    kw.setdefault("backoff_base", 0.01)
    base = server.url + ("/v1" if model.startswith("openai/") else "")
    return LLMClient(model, call_log=log, base_url=base, prices=PRICES, **kw)


def test_k_samples_in_one_request_and_cost(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log)
        [answers] = c.run([req(samples=3)])
    assert server.hits["chat"] == 1 and server.bodies[0]["n"] == 3
    assert [a.value.verdict for a in answers] == ["pass", "fail", "pass"]
    assert [a.value.steps for a in answers] == [[1], [2], [3]]
    # vLLM-style server: thinking switch and structured output in the body
    body = server.bodies[0]
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["response_format"]["json_schema"]["strict"] is True
    # usage: 100 prompt (20 cached), 3 x 10 completion → (80·1 + 20·0.5 + 30·2) / 1e6
    assert c.stats["score"].cost_usd == pytest.approx(150 / 1e6)
    calls = pl.read_parquet(tmp_path / "c.parquet") if export_parquet(
        tmp_path / "calls.sqlite", tmp_path / "c.parquet") else None
    assert calls.height == 3 and calls["cost_usd"].sum() == pytest.approx(150 / 1e6)
    assert calls["input_tokens"].sum() == 80 - 2 or calls["input_tokens"].sum() in (78, 79, 80, 81)


def test_rerun_makes_no_http_request(server, tmp_path):
    requests = [req(f"r{i}", samples=2) for i in range(5)]
    with CallLog(tmp_path / "calls.sqlite") as log:
        first = client(server, log).run(requests)
    hits = server.hits["chat"]
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log)
        again = c.run(requests)
    assert server.hits["chat"] == hits == 5
    assert c.stats["score"].cached == 10 and c.stats["score"].calls == 0
    assert [[a.value for a in r] for r in again] == [[a.value for a in r] for r in first]
    # the sample index is part of the key: asking for 3 samples pays only for the third
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log)
        c.run([req("r0", samples=3)])
    assert server.hits["chat"] == 6 and server.bodies[-1].get("n", 1) == 1


def test_retries_429_500_and_dropped_connections(server, tmp_path):
    server.push("429", retry_after=0.05)
    server.push("500")
    server.push("drop")
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log)
        [[a]] = c.run([req()])
    assert a.status == "ok"
    assert c.stats["score"].failed_attempts == 3 and server.hits["chat"] == 4
    rows = pl.read_database("select status, error from calls", _sqlite(tmp_path))
    assert sorted(rows["status"]) == ["http_error"] * 3 + ["ok"]
    # a dropped connection is told from a timeout (which would hold a slot for --timeout)
    assert "connection dropped by the server" in rows["error"].to_list()


def test_gives_up_after_max_retries(server, tmp_path):
    for _ in range(3):
        server.push("500")
    with CallLog(tmp_path / "calls.sqlite") as log:
        with pytest.raises(LLMError, match="giving up after 3 attempts"):
            client(server, log, max_retries=2).run([req()])


def test_invalid_answers_are_reasked_with_the_error(server, tmp_path):
    server.push("invalid_json")
    server.push("schema_violation")
    with CallLog(tmp_path / "calls.sqlite") as log:
        [[a]] = client(server, log, parse_retries=2).run([req()])
    assert a.status == "ok" and a.attempts == 3
    reask = server.bodies[1]["messages"]
    assert reask[-2]["role"] == "assistant" and "not valid JSON" in reask[-1]["content"]
    assert "not JSON" in reask[-1]["content"]
    assert "schema violation" in server.bodies[2]["messages"][-1]["content"]


def test_exhausted_reasks_are_unanswered_never_guessed(server, tmp_path):
    for _ in range(3):
        server.push("schema_violation")
    with CallLog(tmp_path / "calls.sqlite") as log:
        [[a]] = client(server, log, parse_retries=2).run([req()])
    assert a.status == "unanswered" and a.value is None
    assert "schema violation" in a.reason
    # an unanswered sample is not cached: a rerun asks again
    with CallLog(tmp_path / "calls.sqlite") as log:
        [[b]] = client(server, log).run([req()])
    assert b.status == "ok"


def test_truncation_and_refusal_are_told_apart(server, tmp_path):
    server.push("truncate")
    server.push("truncate")
    server.push("refusal")
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, parse_retries=1)
        [[t]] = c.run([req("a")])
        [[r]] = c.run([req("b")])
    assert t.status == "unanswered" and "truncated at max_tokens" in t.reason
    assert r.status == "unanswered" and r.reason.startswith("refused")
    assert server.hits["chat"] == 3  # a refusal is not asked again


@pytest.mark.parametrize("temperature, calls", [(0.0, 1), (0.7, 3), (None, 3)])
def test_a_truncation_is_asked_again_only_where_sampling_can_end_sooner(server, tmp_path,
                                                                        temperature, calls):
    """At temperature 0 the same question gets the same truncated answer: not paid twice
    (``None``: the server's own temperature, not known to be 0)."""
    for _ in range(3):
        server.push("truncate")
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, parse_retries=2)
        [[a]] = c.run([req(sampling=Sampling(temperature=temperature, max_tokens=64))])
        assert a.status == "unanswered" and "truncated at max_tokens (64)" in a.reason
        assert a.attempts == calls and c.stats["score"].calls == calls
    assert server.hits["chat"] == calls


@pytest.mark.parametrize("temperature, calls", [(0.0, 2), (0.7, 4)])
def test_the_same_invalid_answer_twice_at_temperature_0_ends_the_re_asks(server, tmp_path,
                                                                         temperature, calls):
    for _ in range(4):
        server.push("schema_violation")
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, parse_retries=3)
        [[a]] = c.run([req(sampling=Sampling(temperature=temperature))])
    assert a.status == "unanswered" and a.reason.startswith("schema violation")
    assert a.attempts == calls and server.hits["chat"] == calls


def test_different_invalid_answers_at_temperature_0_are_re_asked(server, tmp_path):
    said = iter(range(100))
    server.answer = lambda body, i: f"not JSON {next(said)}"
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, parse_retries=3)
        [[a]] = c.run([req(sampling=Sampling(temperature=0.0))])
    assert a.status == "unanswered" and a.reason.startswith("not JSON")
    assert server.hits["chat"] == 4


def test_one_truncated_choice_does_not_lose_the_others(server, tmp_path):
    """n=3 in one request; each choice is validated on its own."""
    server.answer = lambda body, i: '{"verdict": "pass", "steps": [1], "reason": "x"}' \
        if i != 1 else '{"verdict": "pa'
    with CallLog(tmp_path / "calls.sqlite") as log:
        [answers] = client(server, log, parse_retries=0).run([req(samples=3)])
    assert [a.status for a in answers] == ["ok", "unanswered", "ok"]


def test_anthropic_messages(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, model="anthropic/test-claude", structured_output="output-format")
        [answers] = c.run([req(samples=2, sampling=Sampling(thinking=True, temperature=0.7,
                                                            max_tokens=4000))])
    assert server.hits["messages"] == 2  # one call per sample
    body = server.bodies[0]
    assert body["system"][0]["text"] == "You judge." and body["messages"][0]["role"] == "user"
    assert body["output_config"]["format"]["type"] == "json_schema"
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2000}
    assert "temperature" not in body  # not allowed with thinking
    assert all(a.status == "ok" for a in answers)
    # Anthropic's input_tokens exclude cache reads: 80 input + 20 cached, 10 output per call
    assert c.stats["score"].usage.input_tokens == 160
    assert c.stats["score"].usage.cached_tokens == 40
    assert c.stats["score"].cost_usd == pytest.approx(2 * (80 * 3 + 20 * 0.3 + 10 * 15) / 1e6)


def test_budget_stop_and_resume(server, tmp_path):
    requests = [req(f"r{i}") for i in range(20)]
    per_call = (80 * 1 + 20 * 0.5 + 10 * 2) / 1e6
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, concurrency=1, max_cost=per_call * 5)
        out = c.run(requests)
    assert c.budget_reached
    assert sum(a.status == "ok" for r in out for a in r) == 5
    assert sum(a.status == "skipped" for r in out for a in r) == 15
    assert server.hits["chat"] == 5
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, max_cost=1.0)
        out = c.run(requests)
    assert all(a.status == "ok" for r in out for a in r)
    assert server.hits["chat"] == 20  # the first five were not paid twice


KILLED_RUN = """
import sys
from tests.test_llm import client, req
from tests.llm_server import FakeLLMServer
from draco_cli.llm import CallLog
class S: url = sys.argv[1]
log = CallLog(sys.argv[2])
c = client(S, log, concurrency=4)
c.run([req(f"r{i}") for i in range(40)])
"""


def test_resume_after_kill_pays_nothing_twice(server, tmp_path):
    server.latency = 0.1
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, server.url,
                             str(tmp_path / "calls.sqlite")], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while server.hits["chat"] < 16:
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the kill"
        assert time.monotonic() < deadline, "timed out after 60 s waiting for 16 calls"
        time.sleep(0.02)
    time.sleep(0.3)  # let the writer commit what has come back
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = server.hits["chat"]
    logged = _answered(tmp_path / "calls.sqlite")
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, concurrency=8)
        out = c.run([req(f"r{i}") for i in range(40)])
    assert all(a.status == "ok" for r in out for a in r)
    assert logged >= 8
    # only what the log did not hold was asked again: at most the calls in flight at the kill
    assert server.hits["chat"] - before == 40 - logged
    # lost: the 4 calls in flight and what came back within the writer's last flush window
    # (4 concurrent calls of 0.1 s = 40 calls/s)
    from draco_cli.llm.calllog import FLUSH_SECONDS

    assert before - logged <= 4 + int(40 * FLUSH_SECONDS) + 2
    rows = pl.read_database("select request_hash, count(*) n from calls where status='ok' "
                            "group by 1", _sqlite(tmp_path))
    assert rows.height == 40 and rows["n"].max() == 1


def test_replay_answers_from_a_recorded_log(server, tmp_path):
    requests = [req(f"r{i}", samples=2) for i in range(3)]
    with CallLog(tmp_path / "calls.sqlite") as log:
        recorded = client(server, log).run(requests)
    hits = server.hits["chat"]
    with CallLog(tmp_path / "replayed.sqlite") as log:
        c = LLMClient(f"replay/{tmp_path / 'calls.sqlite'}", call_log=log)
        replayed = c.run(requests)
    assert server.hits["chat"] == hits
    assert [[a.value for a in r] for r in replayed] == [[a.value for a in r] for r in recorded]
    with CallLog(tmp_path / "replayed2.sqlite") as log:
        c = LLMClient(f"replay/{tmp_path / 'calls.sqlite'}", call_log=log)
        with pytest.raises(ReplayMiss, match="no recorded answer for this score request "
                                             r"\(key 'other', sample 0\)"):
            c.run([req("other")])


@pytest.mark.parametrize("model", ["openai/test-model", "anthropic/test-claude"])
def test_batch_flow(server, tmp_path, model):
    requests = [req(f"r{i}", samples=2) for i in range(4)]
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, model=model)
        out = c.run(requests, batch=True, poll_seconds=0.01)
    assert all(a.status == "ok" for r in out for a in r)
    assert server.hits["chat"] == 0 and server.hits["messages"] == 0
    rows = pl.read_database("select batch_id, cost_usd from calls where status='ok'",
                            _sqlite(tmp_path))
    assert rows.height == 8 and rows["batch_id"].null_count() == 0
    online = client(server, CallLog(tmp_path / "o.sqlite"), model=model)
    online.run([req("x", samples=2)])
    per_sample_online = online.stats["score"].cost_usd / 2
    assert rows["cost_usd"].mean() == pytest.approx(per_sample_online / 2)  # half price
    # a rerun answers from the log, submitting no second batch
    n_batches = server.hits["batches"] + server.hits["anthropic_batches"]
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, model=model).run(requests, batch=True, poll_seconds=0.01)
    assert server.hits["batches"] + server.hits["anthropic_batches"] == n_batches


def test_batch_resumes_by_batch_id(server, tmp_path):
    """A batch submitted by a run that died is polled, not paid for again."""
    requests = [req(f"r{i}") for i in range(3)]
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log)
        import asyncio

        from draco_cli.llm.batch import _submit
        from draco_cli.llm.providers import make_provider

        async def submit_only():
            p = make_provider(c.model, base_url=c.base_url)
            await _submit(c, p, requests, [(k, [0]) for k in range(3)])
            await p.close()

        asyncio.run(submit_only())
    assert server.hits["batches"] == 1
    with CallLog(tmp_path / "calls.sqlite") as log:
        out = client(server, log).run(requests, batch=True, poll_seconds=0.01)
    assert server.hits["batches"] == 1
    assert all(a.status == "ok" for r in out for a in r)


def test_keys_never_appear_in_logs_errors_or_exports(server, tmp_path):
    server.push("401_echo")
    with CallLog(tmp_path / "calls.sqlite") as log, pytest.raises(LLMError) as info:
        client(server, log).run([req()])
    assert PLANTED not in str(info.value)
    assert "[redacted]" in str(info.value)
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log).run([req("ok", samples=2)])
    export_parquet(tmp_path / "calls.sqlite", tmp_path / "calls.parquet")
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert PLANTED.encode() not in path.read_bytes(), path
    # the key did reach the server (so the test is not vacuous)
    assert any(PLANTED in h.get("Authorization", "") for h in server.headers)


def test_unknown_model_spec():
    from draco_cli.errors import UsageError

    with pytest.raises(UsageError, match="write provider/model"):
        LLMClient("gpt-4.1", call_log=None)  # type: ignore[arg-type]


def test_call_log_is_queryable_with_duckdb(server, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log).run([req(f"r{i}") for i in range(3)])
    export_parquet(tmp_path / "calls.sqlite", tmp_path / "llm_calls.parquet")
    got = duckdb.sql(f"select phase, count(*), sum(cost_usd) from "
                     f"'{tmp_path / 'llm_calls.parquet'}' group by phase").fetchall()
    assert got[0][0] == "score" and got[0][1] == 3


def _sqlite(tmp_path):
    return sqlite3.connect(tmp_path / "calls.sqlite")


def test_rpm_limit_is_never_exceeded(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, rpm=600, concurrency=32)  # 10 per second
        t0 = time.perf_counter()
        c.run([req(f"r{i}") for i in range(25)])
        elapsed = time.perf_counter() - t0
    # a one-second bucket of 10, then 10/s: 25 calls need at least 1.5 s
    assert elapsed >= 1.4


def test_thinking_maps_to_each_provider(monkeypatch):
    from draco_cli.llm.providers.anthropic import AnthropicProvider
    from draco_cli.llm.providers.openai import OpenAIProvider

    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    on, off = Sampling(thinking=True), Sampling(thinking=False, temperature=0.2)
    hosted = OpenAIProvider("gpt-x", base_url=None, concurrency=2, timeout=5)
    assert hosted.body(req(sampling=on), [], 1)["reasoning_effort"] == "medium"
    assert "reasoning_effort" not in hosted.body(req(sampling=off), [], 1)
    assert "max_completion_tokens" in hosted.body(req(sampling=on), [], 1)
    vllm = OpenAIProvider("qwen", base_url="http://127.0.0.1:9/v1", concurrency=2, timeout=5)
    assert vllm.body(req(sampling=on), [], 3)["chat_template_kwargs"] == {
        "enable_thinking": True}
    assert vllm.body(req(sampling=on), [], 3)["n"] == 3
    claude = AnthropicProvider("c", base_url=None, concurrency=2, timeout=5)
    assert "thinking" not in claude.body(req(sampling=off), req().messages)
    assert claude.body(req(sampling=off), req().messages)["temperature"] == 0.2


def test_prices_table_and_override(tmp_path):
    from draco_cli.errors import InputError
    from draco_cli.llm.types import Usage

    shipped = PriceTable.load()
    assert shipped.as_of and shipped.price("openai/gpt-4.1") is not None
    # dated snapshots fall back to their base model; unknown models are unpriced (0)
    assert shipped.price("openai/gpt-4.1-2025-04-14") == shipped.price("openai/gpt-4.1")
    assert shipped.cost("openai/my-local-model", Usage(input_tokens=10**6)) == 0.0
    p = tmp_path / "prices.json"
    p.write_text(json.dumps({"models": {"openai/x": {"input": 1, "output": 4}}}))
    t = PriceTable.load(p)
    assert t.cost("openai/x", Usage(input_tokens=10**6, output_tokens=10**6)) == 5.0
    assert t.cost("openai/x", Usage(input_tokens=10**6), batch=True) == 0.5
    p.write_text("{nope")
    with pytest.raises(InputError, match="prices.json: not JSON"):
        PriceTable.load(p)


def test_cli_check_and_export(server, tmp_path):
    from tests.conftest import run_draco

    env_ok = run_draco("llm", "check", "--model", "openai/test-model", "--base-url",
                       server.url + "/v1")
    # the fake server answers with its default Judgement, which is not a Pong: check fails
    assert env_ok.returncode == 1 and b"failed" in env_ok.stderr
    from tests.llm_server import default_answer, schema_answer

    server.answer = schema_answer   # an instance of the judge's schema the check sends
    res = run_draco("llm", "check", "--model", "openai/test-model", "--base-url",
                    server.url + "/v1")
    assert res.returncode == 0 and b"answered valid JSON" in res.stderr
    assert PLANTED.encode() not in res.stderr + res.stdout

    server.answer = default_answer
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log).run([req("a")])
    res = run_draco("llm", "export", "--calls", str(tmp_path / "calls.sqlite"), "-o",
                    str(tmp_path / "calls.parquet"))
    assert res.returncode == 0 and pl.read_parquet(tmp_path / "calls.parquet").height == 1


# --- servers nobody here wrote behave like this (issue 18) ---------------------------------


def _rows(path) -> list[dict]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM calls ORDER BY id")]
    conn.close()
    return rows


def _answered(path) -> int:
    """Distinct (request, sample) pairs the log holds an answer for."""
    return len({(r["request_hash"], r["sample"]) for r in _rows(path) if r["status"] == "ok"})


def test_a_rejected_request_is_not_retried_and_its_reason_is_kept(server, tmp_path):
    server.push("400", message="context_length_exceeded: 9000 tokens > 2048")
    with CallLog(tmp_path / "calls.sqlite") as log:
        with pytest.raises(LLMError, match="HTTP 400: context_length_exceeded"):
            client(server, log).run([req("a")])
    assert server.hits["chat"] == 1
    [row] = _rows(tmp_path / "calls.sqlite")
    assert row["status"] == "http_error" and "context_length_exceeded" in row["response"]


def test_a_500_repeating_its_body_is_a_rejection_not_a_busy_server(server, tmp_path):
    for _ in range(10):
        server.push("500_same")  # what llama-cpp-python answers to response_format json_schema
    with CallLog(tmp_path / "calls.sqlite") as log:
        with pytest.raises(LLMError, match="Input should be 'text' or 'json_object'"):
            client(server, log).run([req("a")])
    assert server.hits["chat"] == 3  # not 7 attempts over a minute
    rows = _rows(tmp_path / "calls.sqlite")
    assert all("json_object" in r["response"] for r in rows)


def test_missing_choices_are_asked_again_one_per_call(server, tmp_path):
    server.push("fewer_choices")  # like llama.cpp, which ignores n
    with CallLog(tmp_path / "calls.sqlite") as log:
        [answers] = client(server, log).run([req("a", samples=3)])
    assert [a.status for a in answers] == ["ok"] * 3 and [a.sample for a in answers] == [0, 1, 2]
    assert [b.get("n", 1) for b in server.bodies] == [3, 1]
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log).run([req("a", samples=3)])
    assert server.hits["chat"] == 2  # all three are logged as answered


def test_no_use_n_asks_one_sample_per_call(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        [answers] = client(server, log, use_n=False).run([req("a", samples=2)])
    assert all(a.status == "ok" for a in answers)
    assert [b.get("n", 1) for b in server.bodies] == [1, 1]


def test_connection_refused_is_one_clear_error(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = LLMClient("openai/m", call_log=log, base_url=f"http://127.0.0.1:{port}/v1",
                      backoff_base=0.01)
        with pytest.raises(LLMError) as err:
            c.run([req("a")])
    msg = str(err.value)
    assert "connection refused" in msg and "timeout" not in msg and "\n" not in msg
    assert "after 3 attempts" in msg


def test_a_host_name_that_does_not_resolve_is_said_so_and_asked_twice_not_a_minute(
        tmp_path, monkeypatch):
    # .invalid never resolves (RFC 2606): with DNS or without, no answer and no wait
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = LLMClient("openai/m", call_log=log, base_url="http://nosuchhost.invalid/v1",
                      backoff_base=0.01, timeout=60)
        t = time.perf_counter()
        with pytest.raises(LLMError) as err:
            c.run([req("a")])
    msg = str(err.value)
    assert "host not found" in msg and "timeout" not in msg and "after 3 attempts" in msg, msg
    assert time.perf_counter() - t < 30


def test_missing_api_key_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("DRACO_BASE_URL", raising=False)
    for model, var in (("openai/gpt-4.1", "OPENAI_API_KEY"),
                       ("anthropic/claude-sonnet-4-5", "ANTHROPIC_API_KEY")):
        with CallLog(tmp_path / "calls.sqlite") as log:
            with pytest.raises(LLMError, match=f"{var} is not set"):
                LLMClient(model, call_log=log).run([req("a")])


@pytest.mark.parametrize("form,field", [
    ("json-schema", lambda b: b["response_format"]["json_schema"]["strict"] is True),
    ("json-schema-loose", lambda b: b["response_format"]["json_schema"]["strict"] is False),
    ("json-object", lambda b: b["response_format"]["type"] == "json_object"
     and b["response_format"]["schema"]["properties"]["verdict"]["enum"] == ["pass", "fail"]),
    ("vllm", lambda b: "response_format" not in b
     and b["structured_outputs"]["json"]["required"] == ["verdict", "steps", "reason"]),
    ("prompt", lambda b: "response_format" not in b
     and "JSON schema" in b["messages"][-1]["content"]),
])
def test_structured_output_forms(server, tmp_path, form, field):
    with CallLog(tmp_path / "calls.sqlite") as log:
        [[a]] = client(server, log, structured_output=form).run([req("a")])
    assert a.status == "ok" and field(server.bodies[-1])


def test_anthropic_tool_form_and_folded_system(server, tmp_path):
    def tool_answer(body, i):
        return json.dumps({"verdict": "pass", "steps": [1], "reason": "ok"})

    server.answer = tool_answer
    with CallLog(tmp_path / "calls.sqlite") as log:
        [[a]] = client(server, log, model="anthropic/test-claude", structured_output="tool",
                       system_role=False).run([req("a")])
    body = server.bodies[-1]
    assert body["tool_choice"] == {"type": "tool", "name": "answer"} and "system" not in body
    assert body["messages"][0]["content"].startswith("You judge.\n\nJudge rollout a.")
    assert a.status == "ok"


def test_a_form_a_provider_does_not_take_is_a_usage_error(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        with pytest.raises(Exception, match="anthropic/ models take"):
            client(server, log, model="anthropic/test-claude",
                   structured_output="json-object").run([req("a")])


def test_fold_system_role_on_openai(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, system_role=False).run([req("a")])
    msgs = server.bodies[-1]["messages"]
    assert [m["role"] for m in msgs] == ["user"] and msgs[0]["content"].startswith("You judge.")


def test_answer_checks_reask_and_old_logged_answers_are_rechecked(server, tmp_path):
    def needs_two_steps(value):
        return None if len(value.steps) >= 2 else "cite at least two steps"

    answers = iter(['{"verdict": "pass", "steps": [1], "reason": "x"}',
                    '{"verdict": "pass", "steps": [1, 2], "reason": "x"}'])
    server.answer = lambda body, i: next(answers)
    with CallLog(tmp_path / "calls.sqlite") as log:
        [[a]] = client(server, log).run([req("a", check=needs_two_steps)])
    assert a.status == "ok" and a.value.steps == [1, 2]
    assert "cite at least two steps" in server.bodies[-1]["messages"][-1]["content"]
    # an answer logged without the check is not served once a check rejects it
    server.answer = lambda body, i: '{"verdict": "pass", "steps": [3], "reason": "x"}'
    with CallLog(tmp_path / "other.sqlite") as log:
        client(server, log).run([req("b")])
    n = server.hits["chat"]
    with CallLog(tmp_path / "other.sqlite") as log:
        [[b]] = client(server, log, parse_retries=0).run(
            [req("b", check=lambda v: None if v.steps != [3] else "no step 3")])
    assert server.hits["chat"] == n + 1 and b.status == "unanswered"


def test_budget_stops_within_one_call_at_any_concurrency(server, tmp_path):
    per_call = (80 * 1 + 20 * 0.5 + 10 * 2) / 1e6
    server.latency = 0.05
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, concurrency=16, max_cost=per_call * 5.5)
        c.run([req(f"r{i}") for i in range(40)])
    assert c.spent <= per_call * 5.5 + per_call
    assert server.hits["chat"] <= 6


def test_unpriced_models_are_null_not_zero(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = LLMClient("openai/self-hosted", call_log=log, base_url=server.url + "/v1")
        c.run([req("a")])
        assert c.stats["score"].priced is False
    assert read_totals(tmp_path / "calls.sqlite")["score"]["cost_usd"] is None
    assert _rows(tmp_path / "calls.sqlite")[0]["cost_usd"] is None


def test_temperature_and_seed_reach_the_request_and_the_cache_key(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, temperature=0.7, seed=11).run([req("a")])
        client(server, log, temperature=0.2, seed=11).run([req("a")])
    assert [(b["temperature"], b["seed"]) for b in server.bodies] == [(0.7, 11), (0.2, 11)]


# --- damaged and old call logs (issue 13) --------------------------------------------------


def test_damaged_call_logs_are_named_never_restarted(server, tmp_path):
    from draco_cli.errors import InputError

    good = tmp_path / "good.sqlite"
    with CallLog(good) as log:
        client(server, log).run([req(f"r{i}") for i in range(30)])
    data = good.read_bytes()
    cases = {"empty": b"", "text": b"hello, not a database\n" * 10,
             "truncated": data[: len(data) // 2]}
    for name, content in cases.items():
        p = tmp_path / f"{name}.sqlite"
        p.write_bytes(content)
        for open_it in (lambda: CallLog(p), lambda: read_totals(p),
                        lambda: export_parquet(p, tmp_path / "x.parquet", force=True),
                        lambda: LLMClient(f"replay/{p}", call_log=CallLog(tmp_path / f"n{name}"))
                        .run([req("r0")])):
            with pytest.raises(InputError, match=f"{p.name}: .*move it aside"):
                open_it()
        assert p.read_bytes() == content  # untouched


def test_old_logs_migrate_and_newer_ones_are_refused(server, tmp_path):

    from draco_cli.errors import InputError
    from draco_cli.llm.calllog import SCHEMA_VERSION

    def schema_version(path):
        conn = sqlite3.connect(path)
        try:
            return conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()

    p = tmp_path / "calls.sqlite"
    with CallLog(p) as log:
        client(server, log).run([req("a")])
    conn = sqlite3.connect(p)
    conn.execute("PRAGMA user_version = 0")  # as written before versions were stamped
    conn.commit()
    conn.close()
    assert schema_version(p) == 0
    with CallLog(p) as log:
        client(server, log).run([req("a")])
    assert server.hits["chat"] == 1 and schema_version(p) == SCHEMA_VERSION
    conn = sqlite3.connect(p)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(InputError, match="newer draco"):
        CallLog(p)


def test_shipped_sample_log_still_replays():
    from draco_cli.llm.providers.replay import ReplayProvider

    log = REPO / "sample_data" / "llm_calls.sqlite"
    recorded = [(r["content_hash"], r["sample"], r["answer_text"]) for r in _rows(log)
                if r["status"] == "ok"]
    answers = ReplayProvider(str(log)).answers
    assert recorded and all(answers.get((h, s)) is not None for h, s, _ in recorded)
    h, s, text = recorded[-1]
    assert answers.get((h, s)).answer_text == text
    assert answers.get(("no such hash", 0)) is None


def test_the_mock_provider_answers_offline_with_no_key_for_llm_check_and_a_run(tmp_path,
                                                                              monkeypatch):
    """``mock/`` answers in-process from each request's own schema: no server, no key."""
    from tests.conftest import run_draco

    for key in [k for k in os.environ if k.endswith("_API_KEY")]:
        monkeypatch.delenv(key)
    res = run_draco("llm", "check", "--model", "mock/any", "--no-parallelism")
    assert res.returncode == 0, res.stderr.decode()
    assert b"answered valid JSON" in res.stderr
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = LLMClient("mock/any", call_log=log)
        [answers] = c.run([req("a", samples=3)])
    assert [a.status for a in answers] == ["ok"] * 3
    assert [a.value.verdict for a in answers] == ["pass", "fail", "pass"]
    assert c.stats["score"].calls == 1 and c.spent == 0.0
    # --no-use-n and the sampling options reach it as they reach a server, so a user's CI can
    # exercise them: one call per sample, each logged with what it asked
    with CallLog(tmp_path / "one.sqlite") as log:
        c = LLMClient("mock/any", call_log=log, use_n=False, temperature=0.7, seed=5)
        [answers] = c.run([req("a", samples=3)])
    assert [a.status for a in answers] == ["ok"] * 3 and c.stats["score"].calls == 3
    bodies = [json.loads(r["request"]) for r in _rows(tmp_path / "one.sqlite") if r["request"]]
    assert [(b["n"], b["temperature"], b["seed"]) for b in bodies] == [(1, 0.7, 5)] * 3


@pytest.mark.parametrize("extra", [[], ["--setting", "static"], ["--setting", "static-no-credit"],
                                   ["--samples", "3"]])
def test_the_shipped_sample_runs_offline_in_every_recorded_setting(tmp_path, extra):
    from tests.conftest import run_draco

    data = REPO / "sample_data" / "appworld_mini"
    res = run_draco("run", "--rollouts", str(data / "rollouts.parquet"), "--steps",
                    str(data / "steps.parquet"), "--model",
                    "replay/sample_data/llm_calls.sqlite", "-o", str(tmp_path / "run"), *extra)
    assert res.returncode == 0, res.stderr.decode()


def test_concurrency_adapts_to_a_server_that_serves_one_at_a_time(server, tmp_path):
    server.serial, server.latency = True, 0.05
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, concurrency=32)
        c.run([req(f"r{i}") for i in range(80)])
    assert c.limit.limit <= 4, c.limit.limit
    assert server.in_flight_max <= 8  # never the 32 the ceiling allows
    server.serial, server.latency = False, 0.1
    with CallLog(tmp_path / "other.sqlite") as log:  # a parallel server: the limit grows
        c = client(server, log, concurrency=32)
        c.run([req(f"r{i}") for i in range(300)])
    assert c.limit.limit >= 16, c.limit.limit


def test_a_short_timeout_on_a_serial_server_does_not_pile_up_copies(server, tmp_path):
    server.serial, server.latency = True, 0.3
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, concurrency=8, timeout=0.5)
        out = c.run([req(f"r{i}") for i in range(12)])
    # a call queued behind others may time out; its retry waits for the abandoned call's slot,
    # so the server's queue stays short and everything is answered
    assert all(a.status == "ok" for r in out for a in r)
    assert server.hits["chat"] <= 12 + 3
    assert server.in_flight_max <= 3


def test_a_timed_out_call_halves_the_limit_and_holds_no_slot():
    """Its connection was closed (tests/test_llm_timeouts.py: the server sees it), so no
    slot is kept for it: the next call goes out at once within the halved limit."""
    import asyncio

    from draco_cli.llm.adaptive import AdaptiveLimit

    async def scenario():
        lim = AdaptiveLimit(4, start=4)
        async with lim:
            lim.timed_out()
        assert lim.limit == 2 and lim.in_flight == 0
        async with lim:
            waiter = asyncio.ensure_future(lim.__aenter__())
            await asyncio.sleep(0.05)
            assert waiter.done()   # two in flight: the halved limit, nothing held besides
            third = asyncio.ensure_future(lim.__aenter__())
            await asyncio.sleep(0.05)
            assert not third.done()   # a third waits: the limit is 2
        await third

    asyncio.run(scenario())


def test_anthropic_prompt_caching_marks_the_stable_prefix(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, model="anthropic/test-claude").run([req("a", samples=2)])
    first, second = server.bodies
    assert first["system"] == [{"type": "text", "text": "You judge.",
                                "cache_control": {"type": "ephemeral"}}]
    # the k samples of one rollout are k calls with one prompt: all of it is cached
    assert first["messages"][-1]["content"][0]["cache_control"] == {"type": "ephemeral"}
    assert first["messages"] == second["messages"]


def test_the_library_leaves_the_garbage_collector_alone(server, tmp_path):
    """A run inside someone else's process (a trainer's) neither freezes the heap nor changes
    the collector's thresholds."""
    import gc

    from tests.llm_server import default_answer

    gc.unfreeze()
    threshold = gc.get_threshold()
    seen: list[tuple[int, tuple[int, ...]]] = []

    def answer(body, index):
        seen.append((gc.get_freeze_count(), gc.get_threshold()))
        return default_answer(body, index)

    server.answer = answer
    with CallLog(tmp_path / "calls.sqlite") as log:
        out = client(server, log, concurrency=4).run([req(f"r{i}") for i in range(6)])
    assert all(a.status == "ok" for r in out for a in r)
    assert seen == [(0, threshold)] * 6
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
