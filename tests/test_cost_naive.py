"""Billed vs naive cost from the call log, and the local server's prompt-cache accounting,
through the real SDKs: figures checked against hand-computed ones."""

from __future__ import annotations

import pytest

from draco_cli.audit import billed_vs_naive, read_cost_rows
from draco_cli.llm import CallLog, LLMClient, PriceTable
from tests.llm_server import PrefixCache, anthropic_prompt, openai_prompt
from tests.llm_server import FakeLLMServer
from tests.test_llm import PLANTED, req

PRICES = PriceTable({"batch_discount": 0.5, "models": {
    "openai/m": {"input": 2.0, "cached_input": 0.5, "output": 8.0},
    "anthropic/c": {"input": 3.0, "cached_input": 0.3, "cache_write": 3.75, "output": 15.0}}},
    "test")
LONG = " ".join(f"word{i}" for i in range(1500))  # ~1500 mock tokens of shared instructions


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", PLANTED)
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    s = FakeLLMServer(caching=True, batch_polls=1).start()
    yield s
    s.stop()


def long_req(key, samples):
    r = req(key, samples=samples)
    r.messages[0]["content"] = LONG
    return r


def client(server, log, model, **kw):
    base = server.url + ("/v1" if model.startswith("openai/") else "")
    return LLMClient(model, call_log=log, base_url=base, prices=PRICES, backoff_base=0.01,
                     **kw)


def test_prefix_cache_rules():
    c = PrefixCache()
    short = [f"t{i}" for i in range(1000)]
    assert c.openai(short) == 0 and c.openai(short) == 0  # under 1024: never cached
    a = [f"a{i}" for i in range(1300)]
    assert c.openai(a) == 0
    b = a[:1200] + ["x"] * 300
    assert c.openai(b) == 1152  # longest shared prefix, in 128-token steps past 1024
    assert c.openai(a) == 1280
    # Anthropic: reads the longest marked prefix cached, writes up to its last mark
    d = PrefixCache()
    toks = [f"s{i}" for i in range(3000)]
    assert d.anthropic(toks, [1500, 3000]) == (0, 3000)
    assert d.anthropic(toks, [1500, 3000]) == (3000, 0)
    other = toks[:1500] + ["y"] * 1000
    assert d.anthropic(other, [1500, 2500]) == (1500, 1000)
    assert d.anthropic(toks[:800], [800]) == (0, 0)  # under the minimum: plain input


@pytest.mark.parametrize("model", ["openai/m", "anthropic/c"])
def test_billed_vs_naive_matches_hand_computation(server, tmp_path, model):
    requests = [long_req(f"r{i}", 3) for i in range(2)]
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, model).run(requests)
    rows = read_cost_rows(tmp_path / "calls.sqlite")
    table = billed_vs_naive(rows, PRICES)
    allrow = table.filter(table["phase"] == "all").to_dicts()[0]
    p = PRICES.price(model)
    if model == "openai/m":
        prompts = [len(openai_prompt(b)) for b in server.bodies]
        assert len(server.bodies) == 2 and allrow["calls"] == 2 and allrow["naive_calls"] == 6
        # the second prompt shares the schema and instructions: cached, in 128-token steps
        cached = allrow["cached_tokens"]
        assert cached > 1024 and (cached - 1024) % 128 in (0, 1, 2)  # rows round their share
    else:
        prompts = [len(anthropic_prompt(b)[0]) for b in server.bodies]
        assert len(server.bodies) == 6 and allrow["calls"] == 6
        assert allrow["cache_write_tokens"] > 0 and allrow["cached_tokens"] > 0
    per_sample = [n for n in prompts for _ in range(3 if model == "openai/m" else 1)]
    assert allrow["naive_input_tokens"] == pytest.approx(sum(per_sample), abs=6)
    naive = (sum(per_sample) * p.input + allrow["output_tokens"] * p.output) / 1e6
    assert allrow["naive_usd"] == pytest.approx(naive, rel=1e-3)
    billed = (allrow["input_tokens"] * p.input + allrow["cached_tokens"] * p.cached_input
              + allrow["cache_write_tokens"] * (p.cache_write or p.input)
              + allrow["output_tokens"] * p.output) / 1e6
    assert allrow["billed_usd"] == pytest.approx(billed, rel=1e-3)
    assert allrow["billed_over_naive"] < 0.6


def test_batch_halves_the_bill_and_unpriced_is_not_zero(server, tmp_path):
    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, "openai/m").run([long_req("r0", 1)], batch=True,
                                            poll_seconds=0.01)
    t = billed_vs_naive(read_cost_rows(tmp_path / "calls.sqlite"), PRICES).to_dicts()[-1]
    assert t["batch_share"] == 1.0 and t["billed_over_naive"] == pytest.approx(0.5, rel=1e-6)
    with CallLog(tmp_path / "u.sqlite") as log:
        client(server, log, "openai/unlisted").run([req("r0")])
    t = billed_vs_naive(read_cost_rows(tmp_path / "u.sqlite"), PRICES).to_dicts()[-1]
    assert t["billed_usd"] is None and t["naive_usd"] is None and t["unpriced_rows"] == 1


def test_audit_cost_command_writes_the_naive_table(server, tmp_path):
    import polars as pl

    from tests.conftest import run_draco

    with CallLog(tmp_path / "run" / "llm_calls.sqlite") as log:
        LLMClient("openai/gpt-4.1", call_log=log,
                  base_url=server.url + "/v1").run([long_req("r0", 3)])
    res = run_draco("audit", "cost", "--calls", str(tmp_path / "run" / "llm_calls.sqlite"),
                    "-o", str(tmp_path / "audit"), "--json")
    assert res.returncode == 0, res.stderr.decode()
    naive = pl.read_parquet(tmp_path / "audit" / "cost_naive.parquet")
    row = naive.filter(pl.col("phase") == "all").to_dicts()[0]
    assert row["calls"] == 1 and row["naive_calls"] == 3
    assert 0 < row["billed_over_naive"] < 0.5
    assert '"billed_vs_naive"' in res.stdout.decode()


def test_online_and_batch_calls_are_apart_in_each_phase(server, tmp_path):
    """One log with a batch and an online call: each phase has an online, a batch and an all
    row, the batch row at the batch price, the online row at the online one; the summed-in-
    SQLite table (the report's) says the same."""
    import polars as pl

    from draco_cli.audit import billed_vs_naive_logs

    with CallLog(tmp_path / "calls.sqlite") as log:
        client(server, log, "openai/m").run([long_req("b0", 1)], batch=True,
                                            poll_seconds=0.01)
        client(server, log, "openai/m").run([req("o0")], batch=False)
    table = billed_vs_naive(read_cost_rows(tmp_path / "calls.sqlite"), PRICES)
    assert table.select("phase", "route").rows() == [
        ("score", "online"), ("score", "batch"), ("score", "all"),
        ("all", "online"), ("all", "batch"), ("all", "all")]
    rows = {r["route"]: r for r in table.filter(pl.col("phase") == "all").iter_rows(named=True)}
    online, batch, every = rows["online"], rows["batch"], rows["all"]
    assert (online["calls"], batch["calls"], every["calls"]) == (1, 1, 2)
    assert online["batch_share"] == 0.0 and batch["batch_share"] == 1.0
    assert every["batch_share"] == 0.5
    # nothing cached across the two (different prompts): online pays list, batch half
    assert online["billed_over_naive"] == pytest.approx(1.0, rel=1e-6)
    assert batch["billed_over_naive"] == pytest.approx(0.5, rel=1e-6)
    assert every["billed_usd"] == pytest.approx(online["billed_usd"] + batch["billed_usd"])
    assert every["naive_usd"] == pytest.approx(online["naive_usd"] + batch["naive_usd"])
    from polars.testing import assert_frame_equal

    assert_frame_equal(billed_vs_naive_logs([tmp_path / "calls.sqlite"], PRICES), table,
                       rel_tol=1e-12)


def test_k_samples_without_n_send_one_ahead_so_the_rest_read_its_cache(monkeypatch, tmp_path):
    """Anthropic answers one sample per call: sent together, each of k calls would write the
    prompt (the cache holds it once a call is answered); one ahead writes it once."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", PLANTED)
    slow = FakeLLMServer(caching=True, latency=0.2).start()
    try:
        with CallLog(tmp_path / "c.sqlite") as log:
            c = client(slow, log, "anthropic/c", concurrency=8, adaptive=False)
            [answers] = c.run([long_req("k", 3)])
    finally:
        slow.stop()
    assert [a.status for a in answers] == ["ok"] * 3
    rows = read_cost_rows(tmp_path / "c.sqlite")
    writes = sorted(rows["cache_write_tokens"].to_list())
    reads = sorted(rows["cached_tokens"].to_list())
    assert writes[0] == writes[1] == 0 < writes[2]   # written once
    assert reads[0] == 0 < reads[1] == reads[2]       # read by the other two
