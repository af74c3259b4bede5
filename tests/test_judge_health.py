"""draco audit judge-health: run folders of several train steps made by `draco run` against the
project's protocol server, with a judge whose pass rate rises with the train step while the
rollouts' outcomes stay the same (flagged) and one whose pass rate does not move (not
flagged); every figure checked against a computation from the run folders' own tables."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import polars as pl
import pytest
from scipy import stats

from draco_cli.errors import UsageError
from tests.conftest import run_draco, sample_step
from tests.llm_server import schema_of, FakeLLMServer

SAMPLE = ["--rollouts", "sample_data/appworld_mini/rollouts.parquet", "--steps",
          "sample_data/appworld_mini/steps.parquet", "--setting", "static"]
STEPS = 6


def _u(*parts: object) -> float:
    """A uniform number in [0, 1) fixed by its parts (the judge's seeded coin)."""
    return int(hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:8], 16) / 2**32


def judge(rate):
    """A judge answering every criterion pass with probability ``rate(step)``; the train step
    is the model's name (openai/step-N)."""
    def answer(body: dict, i: int) -> str:
        step = int(body["model"].rsplit("-", 1)[1])
        user = body["messages"][-1]["content"]
        items = schema_of(body)["properties"]["verdicts"][
            "items"]
        ids = items["properties"]["criterion_id"]["enum"]
        cites = items["properties"]["cited_steps"]["items"].get("enum", [])[:1]
        return json.dumps({"verdicts": [
            {"criterion_id": c, "verdict": "pass" if _u(user, c, step) < rate(step) else "fail",
             "cited_steps": cites, "reason": "r"} for c in ids]})
    return answer


def _inputs(root):
    """Where the sample's rollouts as each step are written: beside the run root."""
    return root.with_name(root.name + "-in")


def make_runs(root, rate, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-health-000000000000")
    s = FakeLLMServer(answer=judge(rate)).start()
    try:
        for n in range(STEPS):
            res = run_draco("run", *sample_step(n, _inputs(root)), *SAMPLE[4:],
                            "--model", f"openai/step-{n}", "--base-url",
                            s.url + "/v1", "--train-step", str(n), "-o", str(root))
            assert res.returncode == 0, res.stderr.decode()
    finally:
        s.stop()
    return root


@pytest.fixture(scope="module")
def rising(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        yield make_runs(tmp_path_factory.mktemp("rising"), lambda s: 0.2 + 0.1 * s, mp)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        yield make_runs(tmp_path_factory.mktemp("flat"), lambda s: 0.5, mp)
    finally:
        mp.undo()


def tables(root):
    """Every step's verdicts joined to its rollouts, titles and rewards, read directly."""
    frames = []
    for n in range(STEPS):
        d = root / f"step-{n}"
        v = pl.read_parquet(d / "judge" / "verdicts.parquet")
        ro = pl.read_parquet("sample_data/appworld_mini/rollouts.parquet")  # the run's input
        rb = pl.read_parquet(d / "rubric" / "rubrics.parquet")
        rw = pl.read_parquet(d / "credit" / "rewards.parquet")
        frames.append(v.join(ro.select("rollout_id", "group_id", "outcome"), on="rollout_id")
                      .join(rb.select("group_id", "criterion_id", "title"),
                            on=["group_id", "criterion_id"])
                      .join(rw.select("rollout_id", "reward"), on="rollout_id")
                      .with_columns(pl.lit(n).alias("step")))
    return pl.concat(frames)


def audit(root, out, *extra):
    res = run_draco("audit", "judge-health", str(root), "-o", str(out), "--json", *extra)
    assert res.returncode == 0, res.stderr.decode()
    return json.loads(res.stdout)


def by_hand(rows: pl.DataFrame):
    """Per step: (pass rate, outcome rate over rollouts, within-group pair agreement)."""
    out = []
    for n in range(STEPS):
        r = rows.filter(pl.col("step") == n)
        pf = [x for x in r["verdict"].to_list() if x in ("pass", "fail")]
        per_rollout = {x["rollout_id"]: x for x in r.iter_rows(named=True)}
        outcome = np.mean([x["outcome"] for x in per_rollout.values()])
        pairs = score = 0
        items = list(per_rollout.values())
        for a in range(len(items)):
            for b in range(a + 1, len(items)):
                x, y = items[a], items[b]
                if x["group_id"] != y["group_id"] or x["outcome"] == y["outcome"]:
                    continue
                pairs += 1
                if x["reward"] == y["reward"]:
                    score += 0.5
                elif (x["reward"] > y["reward"]) == (x["outcome"] > y["outcome"]):
                    score += 1
        out.append((pf.count("pass") / len(pf), outcome, score / pairs))
    return out


def test_rising_pass_rate_with_flat_outcome_is_flagged(rising, tmp_path):
    doc = audit(rising, tmp_path / "h")
    rows = tables(rising)
    hand = by_hand(rows)
    steps = doc["steps"]
    assert [s["train_step"] for s in steps] == list(range(STEPS))
    for s, (p, o, a) in zip(steps, hand):
        assert s["pass_rate"] == pytest.approx(p, abs=1e-12)
        assert s["outcome_rate"] == pytest.approx(o, abs=1e-12)
        assert s["agreement"] == pytest.approx(a, abs=1e-12)
    # every step has the same number of verdicts: the weighted fit is ordinary least squares
    assert len({s["verdicts"] for s in steps}) == 1
    fit = stats.linregress(range(STEPS), [p for p, _, _ in hand])
    run = next(t for t in doc["trends"] if t["scope"] == "run")
    assert run["pass_slope"] == pytest.approx(fit.slope, rel=1e-9)
    assert run["pass_p"] == pytest.approx(fit.pvalue, rel=1e-9)
    assert fit.slope > 0 and fit.pvalue < 0.05
    assert run["outcome_slope"] == 0 and run["flagged"] is True and doc["flagged_run"] is True
    # per criterion (matched by title across steps), the same fit with Holm over criteria
    crit = [t for t in doc["trends"] if t["scope"] == "criterion"]
    titles = sorted(set(rows["title"]))
    assert sorted(t["title"] for t in crit) == titles
    raw = {}
    for title in titles:
        r = rows.filter((pl.col("title") == title) & pl.col("verdict").is_in(["pass", "fail"]))
        rates = [float((r.filter(pl.col("step") == n)["verdict"] == "pass").mean())
                 for n in range(STEPS)]
        raw[title] = stats.linregress(range(STEPS), rates)
    order = sorted(titles, key=lambda t: raw[t].pvalue)
    holm, running = {}, 0.0
    for k, t in enumerate(order):
        running = max(running, min(1.0, (len(order) - k) * raw[t].pvalue))
        holm[t] = running
    for t in crit:
        assert t["pass_slope"] == pytest.approx(raw[t["title"]].slope, rel=1e-9)
        assert t["pass_p_holm"] == pytest.approx(holm[t["title"]], rel=1e-9)
        assert t["flagged"] == (raw[t["title"]].slope > 0 and holm[t["title"]] < 0.05)
    assert doc["flagged_criteria"], "a judge drifting this much flags some criterion"
    # the tables on disk are the ones printed
    trends = pl.read_parquet(tmp_path / "h" / "judge_health_trends.parquet")
    assert trends.filter(pl.col("flagged")).height == sum(t["flagged"] for t in doc["trends"])
    crit_tab = pl.read_parquet(tmp_path / "h" / "judge_health_criteria.parquet")
    assert crit_tab.height == len(titles) * STEPS


def test_flat_pass_rate_is_not_flagged(flat, tmp_path):
    doc = audit(flat, tmp_path / "h")
    hand = by_hand(tables(flat))
    run = next(t for t in doc["trends"] if t["scope"] == "run")
    fit = stats.linregress(range(STEPS), [p for p, _, _ in hand])
    assert run["pass_p"] == pytest.approx(fit.pvalue, rel=1e-9)
    assert not doc["flagged_run"] and doc["flagged_criteria"] == []
    assert not any(t["flagged"] for t in doc["trends"])


def test_too_few_steps_are_not_tested(rising, tmp_path):
    res = run_draco("audit", "judge-health", str(rising / "step-0"), str(rising / "step-1"),
                    "-o", str(tmp_path / "h"), "--json")
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert all(t["pass_p"] is None and not t["flagged"] for t in doc["trends"])
    assert "not tested" in doc["trends"][0]["reason"]


def test_report_shows_the_trend_and_the_banner(rising, flat, tmp_path):
    for root, banner in ((rising, True), (flat, False)):
        out = tmp_path / f"{root.name}.html"
        res = run_draco("report", str(root), "-o", str(out))
        assert res.returncode == 0, res.stderr.decode()
        page = out.read_text()
        assert "<h2 id='judge-health'>Judge health over training steps</h2>" in page
        assert ("<b>Judge health</b> — the judge's pass rate rises" in page) == banner


def test_pass_and_outcome_rising_together_is_not_flagged():
    from draco_cli.audit.judge_health import judge_health

    rng = np.random.default_rng(0)
    v, r = [], []
    for s in range(8):
        for k in range(40):
            ok = rng.random() < 0.2 + 0.08 * s
            r.append({"train_step": s, "rollout_id": f"r{k}", "group_id": f"g{k // 4}",
                      "outcome": float(ok)})
            v.append({"train_step": s, "rollout_id": f"r{k}", "criterion_id": "c",
                      "verdict": "pass" if ok else "fail"})
    h = judge_health(pl.DataFrame(v), pl.DataFrame(r), match="id")
    run = h.trends.row(0, named=True)
    assert run["pass_slope"] > 0 and run["pass_p"] < 0.05
    assert run["outcome_p"] < 0.05 and not run["flagged"]
    # a perfect linear rise (no residual to speak of) is tested, not skipped
    perfect = [{"train_step": s, "rollout_id": f"r{k}", "criterion_id": "c",
                "verdict": "pass" if k < 2 + s else "fail"} for s in range(5) for k in range(10)]
    ro = pl.DataFrame([{"train_step": s, "rollout_id": f"r{k}", "group_id": "g",
                        "outcome": float(k % 2)} for s in range(5) for k in range(10)])
    h = judge_health(pl.DataFrame(perfect), ro, match="id")
    run = h.trends.row(0, named=True)
    assert run["pass_slope"] == pytest.approx(0.1) and run["pass_p"] < 1e-12 and run["flagged"]
    assert math.isclose(run["outcome_slope"], 0.0, abs_tol=1e-12)


def test_bad_input_is_one_line(rising, tmp_path):
    res = run_draco("audit", "judge-health", str(rising / "step-0"), str(rising / "step-0"),
                    "-o", str(tmp_path / "h"))
    assert res.returncode == 2 and b"train step 0 given twice" in res.stderr
    (tmp_path / "empty").mkdir()
    res = run_draco("audit", "judge-health", str(tmp_path / "empty"), "-o", str(tmp_path / "h"))
    assert res.returncode == 2 and b"not a draco run folder" in res.stderr
    res = run_draco("audit", "judge-health", str(rising), "-o", str(tmp_path / "h"),
                    "--min-steps", "2")
    assert res.returncode == 2 and b"--min-steps" in res.stderr
    assert b"Traceback" not in res.stderr


def _step_results(rising):
    """Each run folder's tables as the StepResult an in-loop scorer would have returned."""
    from draco_cli.inloop import CallTally, GroupScore, StepResult

    results, outcomes = [], []
    ro = pl.read_parquet("sample_data/appworld_mini/rollouts.parquet")
    for n in range(STEPS):
        d = rising / f"step-{n}"
        t = {"rubrics": pl.read_parquet(d / "rubric" / "rubrics.parquet"),
             "verdicts": pl.read_parquet(d / "judge" / "verdicts.parquet"),
             "rewards": pl.read_parquet(d / "credit" / "rewards.parquet")}
        groups = []
        for g in sorted(set(t["rewards"]["group_id"])):
            ids = t["rewards"].filter(pl.col("group_id") == g)["rollout_id"]
            groups.append(GroupScore(
                g, t["rubrics"].filter(pl.col("group_id") == g), pl.DataFrame(),
                t["verdicts"].filter(pl.col("rollout_id").is_in(ids.to_list())),
                t["rewards"].filter(pl.col("group_id") == g), pl.DataFrame(), pl.DataFrame(),
                CallTally()))
        results.append(StepResult(n, {}, {}, groups))
        outcomes.append(dict(zip(ro["rollout_id"], ro["outcome"])))
    return results, outcomes


def test_in_loop_history_gives_the_audit_figures(rising, tmp_path):
    """StepResults holding each run folder's tables give the audit's trends."""
    from draco_cli.inloop import judge_health_history

    results, outcomes = _step_results(rising)
    h = judge_health_history(results, outcomes)
    doc = audit(rising, tmp_path / "h")
    def same(a: list[dict], b: list[dict]) -> None:  # summation order may differ: 1e-12
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.keys() == y.keys()
            for k in x:
                assert (x[k] == y[k] if not isinstance(x[k], float) or y[k] is None
                        else x[k] == pytest.approx(y[k], rel=1e-9, abs=1e-12)), k

    same(h.steps.to_dicts(), doc["steps"])
    same(h.trends.drop("reason").to_dicts(),
         [{k: v for k, v in t.items() if k != "reason"} for t in doc["trends"]])


def test_history_asked_every_step_equals_the_whole_history(rising):
    """A JudgeHealthHistory asked after each step (its steps' figures computed once, at the
    health() after their add) gives, at every step, exactly the tables of judge_health_history
    over the steps so far; a step given twice is refused and leaves the history as it was."""
    from polars.testing import assert_frame_equal

    from draco_cli.inloop import JudgeHealthHistory, judge_health_history

    results, outcomes = _step_results(rising)
    history = JudgeHealthHistory()
    for k, (res, out) in enumerate(zip(results, outcomes)):
        history.add(res, out)
        if k % 2 == 0 and k + 1 < len(results):   # also two steps added between two calls
            continue
        got = history.health(min_steps=2)
        want = judge_health_history(results[:k + 1], outcomes[:k + 1], min_steps=2)
        for name in ("steps", "criteria", "trends"):
            assert_frame_equal(getattr(got, name), getattr(want, name), check_exact=True)
    assert history.health(min_steps=2).steps.height == len(results)
    with pytest.raises(UsageError, match="train step 0 given twice"):
        history.add(results[0], outcomes[0])
    assert_frame_equal(history.health().trends, judge_health_history(results, outcomes).trends,
                       check_exact=True)


def test_a_step_that_fails_to_add_leaves_the_history_as_it_was(rising):
    """A step whose tables cannot be read (a reward that is not a number) raises and is not
    half-kept: the same step, mended, is taken after it, and the history equals one that never
    saw the bad step. Tables a caller changes in place do not reach the history."""
    from dataclasses import replace

    from polars.testing import assert_frame_equal

    from draco_cli.inloop import GroupScore, JudgeHealthHistory, judge_health_history

    results, outcomes = _step_results(rising)
    results = [replace(r, train_step=None) for r in results]   # numbered by their place
    history = JudgeHealthHistory()
    history.add(results[0], outcomes[0])
    broken = replace(results[1], groups=[
        GroupScore(**{**g.__dict__, "rewards": g.rewards.with_columns(
            pl.lit("not a number").alias("reward"))}) for g in results[1].groups])
    with pytest.raises(pl.exceptions.InvalidOperationError):
        history.add(broken, outcomes[1])
    for res, out in zip(results[1:], outcomes[1:]):
        history.add(res, out)
    got = history.health(min_steps=2)
    got.steps.drop_in_place("pairs")
    got.criteria.drop_in_place("passes")
    history.add(replace(results[0], train_step=len(results)), outcomes[0])
    again = history.health(min_steps=2)
    want = judge_health_history(
        [*results, replace(results[0], train_step=len(results))], [*outcomes, outcomes[0]],
        min_steps=2)
    for name in ("steps", "criteria", "trends"):
        assert_frame_equal(getattr(again, name), getattr(want, name), check_exact=True)
