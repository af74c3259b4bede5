"""Batch APIs as provider methods, against the local protocol server through the real SDKs:
transient failures while submitting or polling are retried like single calls, a permanent
one is one line, missing samples are re-asked, and offline commands batch by default only
against a hosted API (never a --base-url server)."""

from __future__ import annotations

import ast

import polars as pl
import pytest

from draco_cli.llm import CallLog, LLMClient, LLMError
from draco_cli.llm.providers import make_provider
from tests.conftest import REPO, run_draco
from tests.llm_server import FakeLLMServer
from tests.source_tree import parse
from tests.test_llm import PLANTED, PRICES, req

MODELS = ["openai/test-model", "anthropic/test-claude"]


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    s = FakeLLMServer(batch_polls=3).start()
    yield s
    s.stop()


def client(server, log, model, **kw) -> LLMClient:
    kw.setdefault("backoff_base", 0.01)
    base = server.url + ("/v1" if model.startswith("openai/") else "")
    return LLMClient(model, call_log=log, base_url=base, prices=PRICES, **kw)


@pytest.fixture
def fault_after_submit(monkeypatch, server):
    """Queue faults for the batch API's next requests once the batch is submitted (its polls
    and result reads)."""
    from draco_cli.llm import batch as batch_mod

    queued: list[str] = []
    real = batch_mod._submit

    async def submit_then_fault(*a, **kw):
        out = await real(*a, **kw)
        for kind in queued:
            server.push_batch(kind)
        return out

    monkeypatch.setattr(batch_mod, "_submit", submit_then_fault)
    return queued


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fault", ["500", "429", "drop"])
def test_transient_error_submitting_or_polling_is_retried(server, tmp_path, model, fault,
                                                          fault_after_submit):
    requests = [req(f"r{i}", samples=2) for i in range(3)]
    server.push_batch(fault)  # the first request to the batch API (upload or create)
    fault_after_submit.append(fault)  # and the first poll
    with CallLog(tmp_path / "calls.sqlite") as log:
        out = client(server, log, model).run(requests, batch=True, poll_seconds=0.01)
    assert all(a.status == "ok" for r in out for a in r)
    assert server.hits["chat"] == server.hits["messages"] == 0
    assert server.hits["batches"] + server.hits["anthropic_batches"] == 1  # not paid twice
    # three polls until it ends (one failed and retried), one read of its results
    assert server.hits["batch_polls"] == 4 and not server.batch_faults


@pytest.mark.parametrize("model", MODELS)
def test_permanent_error_while_polling_is_one_line(server, tmp_path, model,
                                                   fault_after_submit):
    fault_after_submit.append("400")
    with CallLog(tmp_path / "calls.sqlite") as log, pytest.raises(LLMError) as info:
        client(server, log, model).run([req("r0")], batch=True, poll_seconds=0.01)
    message = str(info.value)
    assert "\n" not in message and "HTTP 400" in message, message
    assert "injected batch 400" in message and "polling batch" in message, message
    # the batch stays recorded as submitted: a rerun polls it instead of paying again
    fault_after_submit.clear()
    with CallLog(tmp_path / "calls.sqlite") as log:
        out = client(server, log, model).run([req("r0")], batch=True, poll_seconds=0.01)
    assert out[0][0].status == "ok"
    assert server.hits["batches"] + server.hits["anthropic_batches"] == 1


@pytest.mark.parametrize("model", MODELS)
def test_retries_run_out_while_polling(server, tmp_path, model, fault_after_submit):
    fault_after_submit.extend(["500"] * 3)
    with CallLog(tmp_path / "calls.sqlite") as log:
        c = client(server, log, model, max_retries=2)
        with pytest.raises(LLMError, match=r"batch API: giving up after 3 attempts \(HTTP 500"):
            c.run([req("r0")], batch=True, poll_seconds=0.01)


def test_fewer_choices_in_a_batch_are_reasked_one_per_call(server, tmp_path):
    requests = [req(f"r{i}", samples=3) for i in range(2)]
    server.push("fewer_choices")  # the first batch line answers 2 of 3
    with CallLog(tmp_path / "calls.sqlite") as log:
        out = client(server, log, "openai/test-model").run(requests, batch=True,
                                                           poll_seconds=0.01)
    assert [len(r) for r in out] == [3, 3]
    assert all(a.status == "ok" for r in out for a in r)
    assert server.hits["chat"] == 1 and "n" not in server.bodies[-1]  # the missing one, online
    import sqlite3

    rows = sqlite3.connect(tmp_path / "calls.sqlite").execute(
        "select key, sample, batch_id is not null, request from calls where status = 'ok'"
    ).fetchall()
    assert sorted((k, s, b) for k, s, b, _ in rows) == [
        ("r0", 0, 1), ("r0", 1, 1), ("r0", 2, 0), ("r1", 0, 1), ("r1", 1, 1), ("r1", 2, 1)]
    assert all('"messages"' in r for *_, r in rows)  # batch rows keep the body they sent


def test_batch_py_uses_only_public_interfaces():
    tree = parse(REPO / "draco_cli" / "llm" / "batch.py")
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and n.attr.startswith("_") and not n.attr.startswith("__")
               and isinstance(n.value, ast.Name) and n.value.id in ("client", "provider")]
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name)]
    assert private == [] and "isinstance" not in calls


def test_batch_by_default_only_against_a_hosted_api(server, tmp_path, monkeypatch):
    """The auto default: a hosted API (the SDK's own base URL, here pointed at the local
    server through OPENAI_BASE_URL as a user's proxy would be) batches; --base-url never."""
    monkeypatch.delenv("DRACO_BASE_URL", raising=False)
    hosted = make_provider("openai/test-model")
    with CallLog(tmp_path / "c.sqlite") as log:
        assert LLMClient("openai/test-model", call_log=log).batches_by_default(hosted)
        assert not LLMClient("openai/test-model", call_log=log,
                             base_url=server.url + "/v1").batches_by_default(hosted)
        assert not LLMClient(f"replay/{tmp_path / 'c.sqlite'}", call_log=log) \
            .batches_by_default(make_provider(f"replay/{tmp_path / 'c.sqlite'}"))
        monkeypatch.setenv("DRACO_BASE_URL", server.url + "/v1")
        assert not LLMClient("openai/test-model", call_log=log).batches_by_default(hosted)


@pytest.fixture(scope="module")
def tau(tmp_path_factory):
    from tests.conftest import TAU

    d = tmp_path_factory.mktemp("tau")
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(d)).returncode == 0
    return d


def test_offline_commands_batch_by_default(tmp_path, tau, monkeypatch):
    """`rubric generate` and `judge score` with no --batch and no --base-url use the batch API
    and say so; --no-batch answers online; with --base-url they never batch. `draco run`, the
    per-training-step command, calls online unless --batch."""
    from tests.test_rubric_judge import KEY, scripted

    server = FakeLLMServer(answer=scripted, batch_polls=1).start()
    try:
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1")
        monkeypatch.delenv("DRACO_BASE_URL", raising=False)
        r, s = str(tau / "rollouts.parquet"), str(tau / "steps.parquet")
        draco = run_draco

        res = draco("rubric", "generate", "--rollouts", r, "--steps", s, "-o",
                    str(tmp_path / "rb"), "--model", "openai/m")
        assert res.returncode == 0, res.stderr.decode()
        assert server.hits["batches"] >= 1 and server.hits["chat"] == 0
        assert b"batch API (half price; answers typically within hours" in res.stderr
        batches = server.hits["batches"]
        res = draco("judge", "score", "--rollouts", r, "--steps", s, "--rubrics",
                    str(tmp_path / "rb" / "rubrics.parquet"), "-o", str(tmp_path / "j"),
                    "--samples", "2", "--model", "openai/m", "--no-batch")
        assert res.returncode == 0, res.stderr.decode()
        assert server.hits["batches"] == batches and server.hits["chat"] > 0
        chats = server.hits["chat"]
        res = draco("judge", "score", "--rollouts", r, "--steps", s, "--rubrics",
                    str(tmp_path / "rb" / "rubrics.parquet"), "-o", str(tmp_path / "j2"),
                    "--samples", "2", "--model", "openai/m", "--base-url", server.url + "/v1")
        assert res.returncode == 0, res.stderr.decode()
        assert server.hits["batches"] == batches and server.hits["chat"] > chats
        v = pl.read_parquet(tmp_path / "j" / "verdicts_raw.parquet")
        assert v.height > 0
        # draco run: a training step, online by default; --batch asks for the batch API
        batches, chats = server.hits["batches"], server.hits["chat"]
        res = draco("run", "--rollouts", r, "--steps", s, "--model", "openai/m", "-o",
                    str(tmp_path / "run"), "--allow-no-signal")
        assert res.returncode == 0, res.stderr.decode()
        assert server.hits["batches"] == batches and server.hits["chat"] > chats
        assert b"batch API" not in res.stderr
        res = draco("run", "--rollouts", r, "--steps", s, "--model", "openai/m", "-o",
                    str(tmp_path / "run-batched"), "--batch", "--allow-no-signal")
        assert res.returncode == 0, res.stderr.decode()
        assert server.hits["batches"] >= batches + 2
    finally:
        server.stop()


@pytest.mark.parametrize("model", MODELS)
def test_progress_says_what_a_batch_wait_is_waiting_for(server, tmp_path, model):
    seen = []
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, model).run([req("r0")], batch=True, poll_seconds=0.01,
                                       progress=seen.append)
    notes = [p.note for p in seen if p.note]
    assert len(notes) == 2 and "a rerun resumes it" in notes[0]  # two polls before it ended
    assert seen[-1].done == seen[-1].total == 1 and seen[-1].note is None
