"""`draco llm check` advises what works (issue 33): it probes at the temperature the run will
send, with the judge's own schema, every structured-output form, n only where it can be
honoured, and prints the whole line (--max-tokens, --timeout, --temperature included)."""

from __future__ import annotations

import json

import pytest

from draco_cli.llm.checks import run_check
from tests.conftest import run_draco
from tests.llm_server import FakeLLMServer, schema_answer


@pytest.fixture
def server(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    s = FakeLLMServer(answer=schema_answer).start()
    yield s
    s.stop()


def _check(server, **kw):
    kw.setdefault("parallelism", False)
    return run_check("openai/test-model", server.url + "/v1", kw.pop("timeout", 120.0), **kw)


def _forms(body):
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":
        return "json-schema" if rf["json_schema"].get("strict") else "json-schema-loose"
    if rf.get("type") == "json_object":
        return "json-object"
    return "vllm" if "structured_outputs" in body else "prompt"


def test_every_form_is_probed_with_the_judges_schema_and_no_temperature_unless_given(server):
    res = _check(server)
    assert res.ok, res.findings
    forms = [_forms(b) for b in server.bodies[:5]]
    assert forms == ["json-schema", "json-object", "vllm", "json-schema-loose", "prompt"]
    assert [f.what for f in res.findings][:6] == ["temperature"] + [f"form {f}" for f in forms]
    assert all(f.ok for f in res.findings if f.what.startswith("form"))
    # the judge's own schema: criterion ids as an enum, exactly as many verdicts as ids
    schema = server.bodies[0]["response_format"]["json_schema"]["schema"]
    verdicts = schema["properties"]["verdicts"]
    assert verdicts["minItems"] == verdicts["maxItems"] == 2
    assert verdicts["items"]["properties"]["criterion_id"]["enum"] == ["c1", "c2"]
    # no temperature sent, as a run without --temperature, and the check says so
    assert not any("temperature" in b for b in server.bodies)
    assert "none sent" in res.findings[0].detail
    assert res.advice["--structured-output"] == "json-schema"
    assert "--temperature" not in res.advice
    line = res.options()
    assert line.startswith("--structured-output json-schema") and \
        "--max-tokens 1024" in line and "--timeout" in line


def test_the_run_temperature_is_sent_and_printed(server):
    res = _check(server, temperature=0.7)
    assert {b.get("temperature") for b in server.bodies} == {0.7}
    assert res.advice["--temperature"] == "0.7"
    assert [b.get("n", 1) for b in server.bodies].count(2) == 1   # n probed, honoured
    assert "--no-use-n" not in res.advice


def test_n_is_not_probed_at_temperature_0(server):
    """vLLM answers n > 1 under greedy sampling with HTTP 400; probing it there advised
    --no-use-n for every vLLM server."""
    res = _check(server, temperature=0.0)
    assert all(b.get("n", 1) == 1 for b in server.bodies)
    n = next(f for f in res.findings if f.what == "n = 2")
    assert "not probed at temperature 0" in n.detail
    assert "--no-use-n" not in res.advice and res.advice["--temperature"] == "0"


def test_one_id_in_every_slot_is_seen_and_a_clean_form_preferred(server):
    """llama.cpp's grammar keeps criterion ids in the enum, not distinct: the answer has the
    schema's shape, yet every such answer is a re-ask in a run."""
    def answer(body, i):
        if "response_format" in body and body["response_format"]["type"] == "json_schema":
            v = {"criterion_id": "c1", "verdict": "pass", "cited_steps": [1], "reason": "x"}
            return json.dumps({"verdicts": [v, v]})
        return schema_answer(body, i)

    server.answer = answer
    res = _check(server)
    strict = next(f for f in res.findings if f.what == "form json-schema")
    assert not strict.ok and "criterion ids repeated: c1" in strict.detail
    assert res.advice["--structured-output"] == "json-object"


def test_only_repeating_forms_still_pass_with_the_shape_and_say_so(server):
    v = {"criterion_id": "c2", "verdict": "fail", "cited_steps": [2], "reason": "x"}
    server.answer = lambda body, i: json.dumps({"verdicts": [v, v]})
    res = _check(server)
    assert res.ok and res.advice["--structured-output"] == "json-schema"
    assert all("repeated" in f.detail for f in res.findings if f.what.startswith("form"))


def test_timeout_advised_for_max_tokens_at_the_measured_rate(server):
    server.latency = 0.25   # 10 output tokens per call (the fake's count): ~40 tokens/s
    res = _check(server, timeout=10.0, max_tokens=1024)
    rate = next(f for f in res.findings if f.what == "tokens/s")
    assert not rate.ok and "more than --timeout 10" in rate.detail
    # 1024 tokens at <= 40 tokens/s take >= 25.6 s; advised with a margin of 1.5
    assert int(res.advice["--timeout"]) >= 38
    fine = _check(server, timeout=900.0, max_tokens=1024)
    assert fine.advice["--timeout"] == "900"


def test_context_window_from_the_model_card(server):
    server.max_model_len = 4096
    res = _check(server, max_tokens=512)
    window = next(f for f in res.findings if f.what == "context window")
    assert "4096 tokens (/v1/models)" in window.detail and not window.ok
    assert res.advice["--max-prompt-tokens"] == str(int((4096 - 512) * 0.9))
    server.max_model_len = None
    res = _check(server)
    assert "not reported" in next(f for f in res.findings if f.what == "context window").detail
    assert "--max-prompt-tokens" not in res.advice


def test_the_cli_prints_the_whole_line(server):
    res = run_draco("llm", "check", "--model", "openai/test-model", "--base-url",
                    server.url + "/v1", "--no-parallelism", "--temperature", "0.5",
                    "--max-tokens", "300", "--timeout", "90")
    err, out = res.stderr.decode(), res.stdout.decode()
    assert res.returncode == 0, err
    assert "probed at 0.5" in err and "use:" not in err
    # the advised options alone on stdout, one line
    assert out.startswith("use: ") and out.count("\n") == 1, out
    assert "--structured-output json-schema --concurrency" not in out   # no parallelism
    assert "--max-tokens 300 --timeout 90 --temperature 0.5" in out


@pytest.mark.parametrize("args, words", [
    (["--timeout", "-1"], "--timeout -1.0: give a positive number of seconds"),
    (["--timeout", "0"], "--timeout 0.0"),
    (["--max-tokens", "0"], "--max-tokens 0"),
    (["--base-url", "notaurl"], "--base-url: 'notaurl' is not an http(s) URL"),
])
def test_bad_options_are_refused_as_a_run_refuses_them(args, words):
    # checked before any probe: a check advising "--timeout -1" helps nobody
    res = run_draco("llm", "check", "--model", "openai/x", *args)
    err = res.stderr.decode()
    assert res.returncode == 2 and words in err and len(err.strip().splitlines()) == 1, err
