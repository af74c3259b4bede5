"""--rubric-dropout P: a seeded share of each group's retained criteria left out of the reward
and credit. P = 0 writes what draco run wrote before dropout existed (the golden digests); the
same seed gives the same dropout whatever the row order; the credit with dropout is the
reference credit of the verdicts without the dropped criteria, so it conserves each rollout's
total and never flips a sign (SPEC §3.6)."""

from __future__ import annotations

import json
import random

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.credit import compute_credit
from draco_cli.credit.dropout import dropped_criteria
from tests.conftest import examples, run_draco
from tests.reference_credit import reference
from tests.test_credit import frames, pipeline_inputs
from tests.test_golden_outputs import GOLDEN, REPLAY, SAMPLE_R, SAMPLE_S, digest_folder

RUN = ["run", "--rollouts", str(SAMPLE_R), "--steps", str(SAMPLE_S), "--model", REPLAY]


def test_p0_writes_the_golden_outputs(tmp_path):
    res = run_draco(*RUN, "-o", str(tmp_path / "run"), "--rubric-dropout", "0",
                    "--dropout-seed", "7")
    assert res.returncode == 0, res.stderr.decode()
    got = digest_folder(tmp_path)
    golden = {k: v for k, v in json.loads(GOLDEN.read_text())["sample"].items()
              if k.startswith("run/")}
    assert got == golden
    assert not (tmp_path / "run" / "credit" / "rubric_dropout.parquet").exists()


def test_same_seed_same_dropout_and_recorded(tmp_path):
    outs = []
    for name, seed in (("a", 3), ("b", 3)):
        res = run_draco(*RUN, "-o", str(tmp_path / name), "--rubric-dropout", "0.4",
                        "--dropout-seed", str(seed))
        assert res.returncode == 0, res.stderr.decode()
        outs.append(tmp_path / name)
    a, b = (pl.read_parquet(o / "credit" / "rubric_dropout.parquet") for o in outs)
    assert a.height > 0 and a.equals(b)
    assert a["seed"].unique().to_list() == [3] and a["rubric_dropout"].unique().to_list() == [0.4]
    da, db = (digest_folder(o / "credit") for o in outs)
    assert da == db
    # the dropped criteria are out of the reward: n_pass + n_fail over the rest, by hand
    v = pl.read_parquet(outs[0] / "judge" / "verdicts.parquet").join(
        pl.read_parquet(SAMPLE_R).select("rollout_id", "group_id"), on="rollout_id")
    kept = v.filter(pl.col("verdict").eq("fail").any().over("group_id", "criterion_id")).join(
        a.select("group_id", "criterion_id"), on=["group_id", "criterion_id"], how="anti")
    counts = kept.group_by("rollout_id").agg((pl.col("verdict") == "pass").sum().alias("p"),
                                             (pl.col("verdict") == "fail").sum().alias("f"))
    rw = pl.read_parquet(outs[0] / "credit" / "rewards.parquet").join(counts, on="rollout_id")
    assert (rw["n_pass"] == rw["p"]).all() and (rw["n_fail"] == rw["f"]).all()
    m = json.loads((outs[0] / "manifest.json").read_text())
    assert m["settings"]["rubric_dropout"] == 0.4 and m["settings"]["dropout_seed"] == 3
    assert m["stages"]["credit"]["stats"]["criteria_dropout"] == a.height
    # dropout off again in the same folder: its table goes, the outputs are P = 0's
    res = run_draco(*RUN, "-o", str(outs[0]))
    assert res.returncode == 0, res.stderr.decode()
    assert not (outs[0] / "credit" / "rubric_dropout.parquet").exists()


def pairs(groups: int, k: int) -> pl.DataFrame:
    return pl.DataFrame({"group_id": [f"g{g}" for g in range(groups) for _ in range(k)],
                         "criterion_id": [f"c{c}" for _ in range(groups) for c in range(k)]})


def test_share_is_p_and_every_group_keeps_one():
    for k, p in ((5, 0.3), (3, 0.2), (8, 0.5)):
        d = dropped_criteria(pairs(2000, k), p, seed=1)
        per_group = d.group_by("group_id").len()["len"]
        assert per_group.max() <= k - 1
        assert d.height / (2000 * k) == pytest.approx(p, abs=0.02)   # stochastic rounding
    assert dropped_criteria(pairs(500, 1), 0.9, seed=1).height == 0   # one criterion stays
    assert dropped_criteria(pairs(500, 2), 0.99, seed=1).group_by("group_id").len()[
        "len"].max() == 1


def test_dropout_depends_on_the_seed_not_the_row_order():
    base = pairs(200, 5)
    a = dropped_criteria(base, 0.4, seed=11)
    shuffled = base.sample(fraction=1.0, shuffle=True, seed=5)
    assert dropped_criteria(shuffled, 0.4, seed=11).equals(a)
    assert not dropped_criteria(base, 0.4, seed=12).equals(a)


def test_bad_p_is_a_usage_error(tmp_path):
    for p in ("1", "-0.1", "1.5"):
        res = run_draco(*RUN, "-o", str(tmp_path / "r"), "--rubric-dropout", p)
        assert res.returncode == 2 and b"--rubric-dropout" in res.stderr, res.stderr
        assert b"Traceback" not in res.stderr


@settings(max_examples=examples(150), deadline=None)
@given(pipeline_inputs(), st.sampled_from([0.25, 0.5, 0.9]), st.integers(0, 50),
       st.sampled_from(["step", "uniform"]))
def test_dropout_is_the_reference_without_the_dropped(inputs, p, seed, credit):
    rollouts, steps, verdicts = inputs
    r, s, v = frames(rollouts, steps, verdicts)
    res = compute_credit(r, s, v, credit=credit, rubric_dropout=p, dropout_seed=seed)
    gone = {(g, c) for g, c in res.dropout.select("group_id", "criterion_id").iter_rows()}
    group = {x["rollout_id"]: x["group_id"] for x in rollouts}
    # a dropped criterion was retained (somebody failed it) and its group keeps another
    for g, c in gone:
        vs = [x for x in verdicts if group[x["rollout_id"]] == g and x["criterion_id"] == c]
        assert any(x["verdict"] == "fail" for x in vs)
    rest = [x for x in verdicts if (group[x["rollout_id"]], x["criterion_id"]) not in gone]
    ref_r, ref_steps = reference(rollouts, steps, rest, credit=credit)
    for row in res.rewards.iter_rows(named=True):
        reward, A, mode = ref_r[row["rollout_id"]]
        assert row["reward"] == (pytest.approx(reward, abs=1e-12) if reward is not None
                                 else None)
        assert row["advantage"] == pytest.approx(A, rel=1e-9, abs=1e-9)
        assert row["credit_mode"] == mode
    adv = dict(zip(res.rewards["rollout_id"], res.rewards["advantage"]))
    modes = dict(zip(res.rewards["rollout_id"], res.rewards["credit_mode"]))
    sc = res.step_credit
    for row in sc.iter_rows(named=True):
        assert row["advantage"] == pytest.approx(ref_steps[(row["rollout_id"], row["step"])],
                                                 rel=1e-9, abs=1e-9)
        a = adv[row["rollout_id"]]
        assert np.sign(row["advantage"]) in (0.0, np.sign(a))   # never inverted
    for rid, g in sc.group_by("rollout_id"):
        if modes[rid[0]] == "step":   # conservation: Σ n_j a_j = A_i · N
            assert g["total"].sum() == pytest.approx(adv[rid[0]] * g["n_tokens"].sum(),
                                                     rel=1e-9, abs=1e-9)


def test_in_loop_group_credit_marks_the_dropped():
    from draco_cli.inloop.scorer import group_credit
    from draco_cli.options import CreditOptions

    rnd = random.Random(0)
    rollouts = [{"rollout_id": f"r{i}", "group_id": "g", "task_id": "t", "outcome": 1.0,
                 "response_len": 20} for i in range(4)]
    steps = [{"rollout_id": f"r{i}", "step": j, "n_tokens": 10, "token_start": 10 * (j - 1)}
             for i in range(4) for j in (1, 2)]
    verdicts = [{"rollout_id": f"r{i}", "criterion_id": f"c{c}", "judge": "j",
                 "verdict": rnd.choice(["pass", "fail"]), "cited_steps": [1]}
                for i in range(4) for c in range(6)]
    r, s, v = frames(rollouts, steps, verdicts)
    r = r.with_columns(pl.Series("response_len", [20] * 4, dtype=pl.Int32))
    filtered, rewards, _, _ = group_credit(r, s, v, None, CreditOptions(rubric_dropout=0.5,
                                                                         dropout_seed=2))
    res = compute_credit(r, s, v, rubric_dropout=0.5, dropout_seed=2)
    assert set(filtered.filter(pl.col("dropped_out"))["criterion_id"]) == \
        set(res.dropout["criterion_id"]) and res.dropout.height > 0
    assert rewards["advantage"].to_list() == res.rewards["advantage"].to_list()
    plain, _, _, _ = group_credit(r, s, v, None, CreditOptions())
    assert "dropped_out" not in plain.columns
