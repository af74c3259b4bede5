"""draco run --spot-check N: run folders of six train steps made against the project's protocol
server, where the training judge (openai/step-N) passes more each step while the gold judge
(openai/gold-N) does not; the gold verdicts, their call log, the per-step agreement and kappa
and the flag, checked against a computation from the run folders' own tables."""

from __future__ import annotations

import json
import sqlite3

import polars as pl
import pytest
from scipy import stats

from tests.conftest import run_draco, sample_step
from tests.llm_server import schema_of, FakeLLMServer
from tests.test_judge_health import SAMPLE, STEPS, _inputs, _u

N = 40


def judges(train_rate, gold_rate):
    """Both judges answer pass when the same seeded coin (prompt, criterion, step) is below
    their rate: the gold judge's passes are a subset of the training judge's."""
    def answer(body: dict, i: int) -> str:
        model = body["model"]
        step = int(model.rsplit("-", 1)[1])
        rate = gold_rate(step) if model.startswith("gold-") else train_rate(step)
        user = body["messages"][-1]["content"]
        items = schema_of(body)["properties"]["verdicts"][
            "items"]
        ids = items["properties"]["criterion_id"]["enum"]
        cites = items["properties"]["cited_steps"]["items"].get("enum", [])[:1]
        return json.dumps({"verdicts": [
            {"criterion_id": c, "verdict": "pass" if _u(user, c, step) < rate else "fail",
             "cited_steps": cites, "reason": "r"} for c in ids]})
    return answer


def make_runs(root, train_rate, gold_rate, monkeypatch, *extra):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-spot-0000000000000")
    s = FakeLLMServer(answer=judges(train_rate, gold_rate)).start()
    try:
        for n in range(STEPS):
            res = run_draco("run", *sample_step(n, _inputs(root)), *SAMPLE[4:],
                            "--model", f"openai/step-{n}", "--base-url",
                            s.url + "/v1", "--train-step", str(n), "-o", str(root),
                            "--spot-check", str(N), "--spot-check-model", f"openai/gold-{n}",
                            "--spot-check-base-url", s.url + "/v1", *extra)
            assert res.returncode == 0, res.stderr.decode()
    finally:
        s.stop()
    return root, s


@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        yield make_runs(tmp_path_factory.mktemp("drift"), lambda s: 0.2 + 0.15 * s,
                        lambda s: 0.2, mp)
    finally:
        mp.undo()


def kappa_by_hand(a, b):
    n = len(a)
    po = sum(x == y for x, y in zip(a, b)) / n
    pe = sum(a.count(c) / n * b.count(c) / n for c in set(a) | set(b))
    return None if pe == 1 else (po - pe) / (1 - pe)


def test_spot_checks_are_sampled_asked_and_logged(drifting):
    root, server = drifting
    for n in range(STEPS):
        d = root / f"step-{n}"
        spot = pl.read_parquet(d / "judge" / "spot_checks.parquet")
        v = pl.read_parquet(d / "judge" / "verdicts.parquet")
        assert spot.height == N and spot["seed"].unique().to_list() == [0]
        assert spot["train_step"].unique().to_list() == [n]
        assert spot.select("rollout_id", "criterion_id").is_unique().all()
        # the training judge's verdict is the one in its table
        joined = spot.join(v, on=["rollout_id", "criterion_id"])
        assert joined.height == N and (joined["judge_verdict"] == joined["verdict"]).all()
        # the gold answers are in the gold's own call log, none in the training judge's
        with sqlite3.connect(d / "spot_check_calls.sqlite") as c:
            models = {m for (m,) in c.execute("SELECT model FROM calls")}
        assert models == {f"openai/gold-{n}"}, models
        with sqlite3.connect(d / "llm_calls.sqlite") as c:
            assert not [m for (m,) in c.execute("SELECT model FROM calls") if "gold" in m]
        m = json.loads((d / "manifest.json").read_text())
        assert m["stages"]["spot_check"]["status"] == "done"
        assert m["settings"]["spot_check"] == N
        assert m["settings"]["spot_check_model"] == f"openai/gold-{n}"
        # the gold judge's verdict: its coin, from the same prompt
        assert (spot["gold_pass"] == (spot["gold_verdict"] == "pass")).all()
    # same rate, same coin: the gold passes a subset of what the judge passes
    all_spots = pl.concat([pl.read_parquet(root / f"step-{n}" / "judge" / "spot_checks.parquet")
                           for n in range(STEPS)])
    assert not (all_spots["gold_pass"] & ~all_spots["judge_pass"]).any()


def test_spot_check_never_changes_the_reward(drifting, tmp_path, monkeypatch):
    """The same step without --spot-check, against the same judge: identical credit tables."""
    root, _ = drifting
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-spot-0000000000000")
    s = FakeLLMServer(answer=judges(lambda s: 0.2 + 0.15 * s, lambda s: 0.2)).start()
    try:
        res = run_draco("run", *sample_step(3, _inputs(root)), *SAMPLE[4:], "--model",
                        "openai/step-3", "--base-url", s.url + "/v1", "-o",
                        str(tmp_path / "nospot"))
    finally:
        s.stop()
    assert res.returncode == 0, res.stderr.decode()
    d = root / "step-3"
    for f in ("rewards.parquet", "step_credit.parquet", "token_advantages.parquet"):
        assert pl.read_parquet(tmp_path / "nospot" / "credit" / f).equals(
            pl.read_parquet(d / "credit" / f)), f
    assert not (tmp_path / "nospot" / "judge" / "spot_checks.parquet").exists()


def test_rerun_pays_no_gold_call_twice(drifting, monkeypatch):
    root, _ = drifting
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-spot-0000000000000")
    d = root / "step-2"
    before = pl.read_parquet(d / "judge" / "spot_checks.parquet")
    (d / "judge" / "spot_checks.parquet").unlink()   # the stage must redo, from its log
    res = run_draco("run", *sample_step(2, _inputs(root)), *SAMPLE[4:], "--model",
                    "openai/step-2", "--base-url",
                    "http://127.0.0.1:9/v1", "--train-step", "2", "-o", str(root),
                    "--spot-check", str(N), "--spot-check-model", "openai/gold-2",
                    "--spot-check-base-url", "http://127.0.0.1:9/v1")   # nothing listens
    assert res.returncode == 0, res.stderr.decode()
    assert b"spot_check: done" in res.stderr and b"0 new" in res.stderr
    assert pl.read_parquet(d / "judge" / "spot_checks.parquet").equals(before)


def test_agreement_falls_while_the_pass_rate_rises_is_flagged(drifting, tmp_path):
    root, _ = drifting
    res = run_draco("audit", "judge-health", str(root), "-o", str(tmp_path / "h"), "--json")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    agree, weights = [], []
    for s, n in zip(doc["steps"], range(STEPS)):
        spot = pl.read_parquet(root / f"step-{n}" / "judge" / "spot_checks.parquet")
        a, b = spot["judge_verdict"].to_list(), spot["gold_verdict"].to_list()
        share = sum(x == y for x, y in zip(a, b)) / len(a)
        assert s["spot_n"] == len(a)
        assert s["spot_agreement"] == pytest.approx(share, abs=1e-12)
        k = kappa_by_hand(a, b)
        assert (s["spot_kappa"] is None) if k is None else \
            s["spot_kappa"] == pytest.approx(k, abs=1e-12)
        jp = [x == "pass" for x in a if x != "na"]
        assert s["spot_judge_pass_rate"] == pytest.approx(sum(jp) / len(jp), abs=1e-12)
        agree.append(share)
        weights.append(len(a))
    assert len(set(weights)) == 1   # equal weights: the weighted fit is ordinary least squares
    fit = stats.linregress(range(STEPS), agree)
    row = next(t for t in doc["trends"] if t["scope"] == "spot_check")
    assert row["agreement_slope"] == pytest.approx(fit.slope, rel=1e-9)
    assert row["agreement_p"] == pytest.approx(fit.pvalue, rel=1e-9)
    run = next(t for t in doc["trends"] if t["scope"] == "run")
    assert row["pass_slope"] == pytest.approx(run["pass_slope"], rel=1e-12)
    assert fit.slope < 0 and fit.pvalue < 0.05 and run["pass_slope"] > 0
    assert row["flagged"] is True and doc["flagged_spot_check"] is True
    # on disk as printed
    t = pl.read_parquet(tmp_path / "h" / "judge_health_trends.parquet")
    assert t.filter(pl.col("scope") == "spot_check")["flagged"].to_list() == [True]
    s = pl.read_parquet(tmp_path / "h" / "judge_health_steps.parquet")
    assert s["spot_agreement"].to_list() == pytest.approx(agree, abs=1e-12)


def test_agreeing_judges_are_not_flagged(tmp_path, monkeypatch):
    """The gold judge answers as the training judge does: agreement 1 every step."""
    root, _ = make_runs(tmp_path / "same", lambda s: 0.2 + 0.15 * s,
                        lambda s: 0.2 + 0.15 * s, monkeypatch)
    res = run_draco("audit", "judge-health", str(root), "-o", str(tmp_path / "h"), "--json")
    doc = json.loads(res.stdout)
    assert [s["spot_agreement"] for s in doc["steps"]] == [1.0] * STEPS
    row = next(t for t in doc["trends"] if t["scope"] == "spot_check")
    assert row["agreement_slope"] == 0 and not row["flagged"]
    assert doc["flagged_spot_check"] is False


def test_report_shows_the_gold_agreement(drifting, tmp_path):
    root, _ = drifting
    out = tmp_path / "r.html"
    res = run_draco("report", str(root), "-o", str(out))
    assert res.returncode == 0, res.stderr.decode()
    page = out.read_text()
    assert "agreement with the gold judge" in page
    assert "agrees less with the gold judge" in page   # the flag's reason, in the banner
    assert "<b>spot checks (the training judge against the gold judge)</b>" in page


def test_bad_spot_check_options_are_one_line(tmp_path):
    base = ["run", *SAMPLE, "--model", "replay/sample_data/llm_calls.sqlite", "-o",
            str(tmp_path / "r")]
    res = run_draco(*base, "--spot-check", "5")
    assert res.returncode == 2 and b"--spot-check-model" in res.stderr
    res = run_draco(*base, "--spot-check-model", "replay/sample_data/llm_calls.sqlite")
    assert res.returncode == 2 and b"--spot-check N" in res.stderr
    res = run_draco(*base, "--spot-check-base-url", "http://x/v1")
    assert res.returncode == 2 and b"--spot-check-model" in res.stderr
    res = run_draco("run", "--rollouts", "sample_data/appworld_mini/rollouts.parquet",
                    "--steps", "sample_data/appworld_mini/steps.parquet", "--setting",
                    "outcome", "-o", str(tmp_path / "o"), "--spot-check", "3",
                    "--spot-check-model", "replay/sample_data/llm_calls.sqlite")
    assert res.returncode == 2 and b"no judge to check" in res.stderr
    assert b"Traceback" not in res.stderr
