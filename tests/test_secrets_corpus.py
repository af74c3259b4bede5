"""A hostile corpus of secrets: common credential forms planted in rollouts (instructions,
actions and tool arguments, observations) must not reach what draco sends or writes: the
requests a judge server receives, the call log, every output table, the HTML report, and
error messages. Each secret is made fresh (random characters) so nothing can match it by
chance; the words of ordinary text around them must survive."""

from __future__ import annotations

import base64
import json
import random
import sqlite3
import string

import polars as pl
import pytest

from draco_cli.redact import redact
from tests.conftest import REPO, run_draco

SAMPLE = REPO / "sample_data" / "appworld_mini"
RNG = random.Random(31)


def _r(n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(RNG.choice(alphabet) for _ in range(n))


def corpus() -> list[tuple[str, str, str]]:
    """(form, text holding the secret, the secret itself)."""
    pw, user = _r(14) + "!x9", "svc_" + _r(5).lower()
    pem_body = "\n".join(_r(64, string.ascii_letters + string.digits + "+/") for _ in range(3))
    pem = f"-----BEGIN RSA PRIVATE KEY-----\n{pem_body}\n-----END RSA PRIVATE KEY-----"
    basic = base64.b64encode(f"{user}:{pw}".encode()).decode()
    hexs = _r(40, "0123456789abcdef")
    out = [
        ("pem", f"cat ~/.ssh/id_rsa\n{pem}\n", pem_body.splitlines()[1]),
        ("pem in json", json.dumps({"type": "service_account", "private_key": pem + "\n"}),
         pem_body.splitlines()[0]),
        ("url credentials", f"psql postgres://{user}:{pw}@db.internal:5432/app", pw),
        ("mongodb+srv", f'MONGO_URL="mongodb+srv://{user}:{pw}@cluster0.x.net/db"', pw),
        ("basic auth", f"curl -H 'Authorization: Basic {basic}' https://api.x", basic),
        ("bearer", f'{{"headers": {{"Authorization": "Bearer {_r(32)}"}}}}', None),
        ("stripe", f"stripe.api_key = 'sk_live_{_r(24)}'", None),
        ("stripe test", f"key rk_test_{_r(24)} loaded", None),
        ("hugging face", f"HF_TOKEN=hf_{_r(34)} huggingface-cli login", None),
        ("gitlab", f"git clone https://oauth2:glpat-{_r(20)}@gitlab.com/x/y.git", None),
        ("json password", json.dumps({"username": user, "password": pw}), pw),
        ("yaml", f"database:\n  host: db\n  password: {pw}\n  api_key: {hexs}\n", hexs),
        ("env", f"AWS_SECRET_ACCESS_KEY={_r(40, string.ascii_letters + string.digits + '/+')}",
         None),
        ("client secret", f'{{"client_id": "abc", "client_secret": "{_r(30)}"}}', None),
        ("token field", f"token: {_r(36)}", None),
        ("aws key id", f"aws_access_key_id = AKIA{_r(16, string.ascii_uppercase + string.digits)}",
         None),
        ("github", f"export GH=ghp_{_r(36)}", None),
        ("github fine-grained", f"github_pat_{_r(60, string.ascii_letters + '_' + string.digits)}",
         None),
        ("slack", f"xoxb-{_r(12, string.digits)}-{_r(24)}", None),
        ("google", f"https://maps.googleapis.com/?key=AIza{_r(35)}", None),
        ("jwt", "eyJ" + _r(20) + ".eyJ" + _r(40) + "." + _r(43), None),
        ("openai", f"OPENAI_API_KEY=sk-proj-{_r(48)}", None),
        ("anthropic", f"client = Anthropic(api_key='sk-ant-api03-{_r(40)}')", None),
        ("azure", f"DefaultEndpointsProtocol=https;AccountName=x;AccountKey={_r(86)}==;"
         "EndpointSuffix=core.windows.net", None),
        ("npm", f"//registry.npmjs.org/:_authToken=npm_{_r(36)}", None),
        ("prose", f"ok, my password is {pw} then", pw),
        ("flag", f"mysqladmin --password {pw} status", pw),
    ]
    found = []
    for form, text, secret in out:
        if secret is None:   # the token itself: the longest run of its characters
            secret = max((w for w in text.replace("'", " ").replace('"', " ").replace("=", " ")
                          .replace(":", " ").split()), key=len)
        found.append((form, text, secret))
    return found


CORPUS = corpus()
ORDINARY = ["the token budget", "commit 3f2a9c1e5b7d8f0a1b2c3d4e5f60718293a4b5c6",
            "rollout 550e8400-e29b-41d4-a716-446655440000", "basic economy"]


@pytest.mark.parametrize("form,text,secret", CORPUS, ids=[c[0] for c in CORPUS])
def test_default_redaction_masks_each_form(form, text, secret):
    assert secret in text
    assert secret not in redact(text), (form, redact(text))


def test_ordinary_text_is_left_alone():
    for text in ORDINARY + ['{"token": "Hello", "logprob": -0.25}', "max_tokens: 512",
                            "sort(key=lambda r: r.id)", "eos_token: </s>", "secretary: Ann",
                            "see http://example.com:8080/a and git@github.com:o/r.git",
                            "the password is incorrect"]:
        assert redact(text) == text, text


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The sample rollouts with every secret planted in instructions, actions and
    observations."""
    d = tmp_path_factory.mktemp("secrets")
    r = pl.read_parquet(SAMPLE / "rollouts.parquet")
    s = pl.read_parquet(SAMPLE / "steps.parquet")
    texts = [c[1] for c in CORPUS]
    r = r.with_columns(pl.Series("instruction", [
        f"{x}\nCredentials: {texts[i % len(texts)]}" for i, x in enumerate(r["instruction"])]))
    s = s.with_columns(
        pl.Series("action", [f"{a}\n# tool args: {texts[(i + 3) % len(texts)]}"
                             for i, a in enumerate(s["action"])]),
        pl.Series("observation", [f"{o or ''}\n{texts[(i + 7) % len(texts)]}"
                                  for i, o in enumerate(s["observation"])]))
    r.write_parquet(d / "rollouts.parquet")
    s.write_parquet(d / "steps.parquet")
    return d


def _leaks(text: str) -> list[str]:
    return [form for form, _, secret in CORPUS if secret in text]


def _run_folder_text(run) -> str:
    """Every output of a run folder as text: each Parquet table, the manifest, the call log."""
    parts = []
    for p in sorted(run.rglob("*.parquet")):
        parts.append(pl.read_parquet(p).write_ndjson())
    parts.append((run / "manifest.json").read_text())
    conn = sqlite3.connect(run / "llm_calls.sqlite")
    for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        parts += [json.dumps(row, default=str) for row in conn.execute(f"SELECT * FROM {table}")]
    conn.close()
    return "\n".join(parts)


def _check_run(planted, run, res):
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert _leaks(_run_folder_text(run)) == []
    assert _leaks(res.stderr.decode() + res.stdout.decode()) == []
    report = run.parent / f"{run.name}.html"
    rep = run_draco("report", run, "-o", report)
    assert rep.returncode == 0, rep.stderr.decode()
    html = report.read_text()
    assert _leaks(html) == []
    assert "[REDACTED]" in html


def test_no_secret_reaches_the_mock_judge_outputs_or_report(planted, tmp_path):
    run = tmp_path / "run"
    res = run_draco("run", "--rollouts", planted / "rollouts.parquet", "--steps",
                    planted / "steps.parquet", "--model", "mock/x", "-o", run)
    _check_run(planted, run, res)
    log = sqlite3.connect(run / "llm_calls.sqlite")
    bodies = [b for (b,) in log.execute("SELECT request FROM calls") if b]
    log.close()
    assert bodies and all("[REDACTED]" in b for b in bodies[:3])


def test_no_secret_reaches_a_judge_server(planted, tmp_path, monkeypatch):
    from tests.llm_server import FakeLLMServer, schema_answer

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secrets-000000000000")
    server = FakeLLMServer(answer=schema_answer).start()
    try:
        run = tmp_path / "run"
        res = run_draco("run", "--rollouts", planted / "rollouts.parquet", "--steps",
                        planted / "steps.parquet", "--model", "openai/m", "--base-url",
                        server.url + "/v1", "-o", run,
                        "--allow-no-signal")   # the server answers every rollout alike
        _check_run(planted, run, res)
        sent = json.dumps(server.bodies)
    finally:
        server.stop()
    assert server.bodies and _leaks(sent) == []
    # the rollouts' ordinary words went through
    assert "Credentials:" in sent and "tool args" in sent


def test_error_messages_do_not_quote_a_secret(planted, tmp_path):
    run = tmp_path / "run"
    assert run_draco("run", "--rollouts", planted / "rollouts.parquet", "--steps",
                     planted / "steps.parquet", "--model", "mock/x", "-o", run).returncode == 0
    for form, _, secret in CORPUS[:12]:
        res = run_draco("sql", run, f'SELECT * FROM "password={secret}"')
        assert res.returncode == 2
        assert secret not in res.stderr.decode(), form
