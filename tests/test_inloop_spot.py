"""spot_check=N and rubric_dropout in the training loop (StepScorer), against the project's
protocol server: the gold judge (openai/gold) answers the training judge's prompt with pass and
fail swapped; its answers go to their own call log, never into an advantage; the agreement
figures are the table's; a restarted trainer pays no gold call twice."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import numpy as np
import polars as pl
import pytest

from draco_cli.errors import UsageError
from draco_cli.inloop import StepScorer, judge_health_history, write_step
from tests.llm_server import FakeLLMServer
from tests.test_inloop_step import GROUP, batch, decode
from tests.test_rubric_judge import scripted

N = 10
SWAP = {"pass": "fail", "fail": "pass", "na": "na"}


def answer(body: dict, i: int) -> str:
    text = scripted(body, i)
    if body["model"] != "gold":
        return text
    doc = json.loads(text)
    for v in doc["verdicts"]:
        v["verdict"] = SWAP[v["verdict"]]
    return json.dumps(doc)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=answer).start()
    yield s
    s.stop()


def models(log) -> dict[str, int]:
    with sqlite3.connect(log) as c:
        return dict(c.execute("select model, count(*) from calls group by model").fetchall())


def score(server, tmp_path, steps=(1, 2, 3), **kw):
    async def main():
        async with StepScorer("openai/m", base_url=server.url + "/v1", group_size=GROUP,
                              decode=decode, call_log=tmp_path / "calls.sqlite", **kw) as s:
            return [await s.score_step(batch(seed=n, step=n), n) for n in steps]
    return asyncio.run(main())


def test_spot_checks_in_the_loop(server, tmp_path):
    gold = {"spot_check": N, "spot_check_model": "openai/gold",
            "spot_check_llm": {"base_url": server.url + "/v1"}}
    results = score(server, tmp_path, **gold)
    plain = score(server, tmp_path / "plain")
    for res, ref in zip(results, plain):   # the gold judge never reaches an advantage
        assert res.rows.keys() == ref.rows.keys()
        for k in res.rows:
            np.testing.assert_array_equal(res.rows[k].values, ref.rows[k].values)
        spot = res.spot_checks
        assert spot.height == N and spot["train_step"].unique().to_list() == [res.train_step]
        v = res.tables()["verdicts"]
        j = spot.join(v, on=["rollout_id", "criterion_id"])
        assert (j["judge_verdict"] == j["verdict"]).all()
        assert (spot["gold_verdict"] == spot["judge_verdict"].replace_strict(SWAP)).all()
        agree = (spot["judge_verdict"] == "na").mean()   # only na survives the swap
        assert res.metrics["draco/spot_check_agreement"] == pytest.approx(agree)
        assert res.metrics["draco/spot_check_n"] == N
        assert ref.spot_checks is None and "draco/spot_check_n" not in ref.metrics
    # the gold's calls in their own log, beside the trainer's
    assert set(models(tmp_path / "calls.spot_check.sqlite")) == {"openai/gold"}
    assert "openai/gold" not in models(tmp_path / "calls.sqlite")
    paid = models(tmp_path / "calls.spot_check.sqlite")["openai/gold"]
    # a restarted trainer: the same steps again pay no gold call
    again = score(server, tmp_path, **gold)
    assert models(tmp_path / "calls.spot_check.sqlite")["openai/gold"] == paid
    for a, b in zip(again, results):
        assert a.spot_checks.equals(b.spot_checks)
    # judge health over the history: the agreement per step is the table's
    outcomes = [{r.rollout_id: r.outcome for r in batch(seed=n, step=n)} for n in (1, 2, 3)]
    h = judge_health_history(results, outcomes)
    want = [float((r.spot_checks["judge_verdict"] == "na").mean()) for r in results]
    assert h.steps["spot_agreement"].to_list() == pytest.approx(want)
    assert h.steps["spot_n"].to_list() == [N] * 3
    assert h.trends.filter(pl.col("scope") == "spot_check").height == 1
    folder = write_step(results[0], tmp_path / "steps")
    assert pl.read_parquet(folder / "judge" / "spot_checks.parquet").equals(
        results[0].spot_checks)


def test_rubric_dropout_in_the_loop(server, tmp_path):
    a = score(server, tmp_path / "a", steps=(1,), rubric_dropout=0.5, dropout_seed=4)[0]
    b = score(server, tmp_path / "b", steps=(1,), rubric_dropout=0.5, dropout_seed=4)[0]
    ref = score(server, tmp_path / "c", steps=(1,))[0]
    va, vb = a.tables()["verdicts"], b.tables()["verdicts"]
    assert va["dropped_out"].any() and va.equals(vb)
    for k in a.rows:
        np.testing.assert_array_equal(a.rows[k].values, b.rows[k].values)
    assert "dropped_out" not in ref.tables()["verdicts"].columns
    # only retained criteria are dropped, and every group keeps one
    assert not (va["dropped_out"] & ~va["retained"]).any()
    kept = va.filter(pl.col("retained") & ~pl.col("dropped_out"))
    assert kept.join(va.select("rollout_id"), on="rollout_id").height > 0
    assert a.metrics["draco/criteria_kept"] == ref.metrics["draco/criteria_kept"]


def test_bad_in_loop_settings_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="spot_check_model"):
        StepScorer("openai/m", group_size=2, decode=decode, call_log=tmp_path / "c.sqlite",
                   spot_check=3)
    with pytest.raises(UsageError, match="rubric-dropout"):
        StepScorer("openai/m", group_size=2, decode=decode, call_log=tmp_path / "c.sqlite",
                   rubric_dropout=1.0)
