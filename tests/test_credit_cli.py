"""draco judge filter / credit compute / credit expand through the real CLI."""

from __future__ import annotations


import numpy as np
import polars as pl
import pytest

from draco_cli.io import write_table
from draco_cli.schemas import VerdictAggregated
from tests.conftest import SAMPLE, TAU, run_draco


def make_verdicts(steps: pl.DataFrame, rollouts: pl.DataFrame, seed=0, judges=("frontier",)):
    rng = np.random.default_rng(seed)
    m = dict(steps.group_by("rollout_id").len().iter_rows())
    rows = []
    for judge in judges:
        for rid in rollouts["rollout_id"]:
            for c in range(5):
                M = m.get(rid, 0)
                rows.append({
                    "rollout_id": rid, "criterion_id": f"c{c}", "judge": judge,
                    "verdict": rng.choice(["pass", "fail", "na", None], p=[.5, .3, .1, .1]),
                    "cited_steps": sorted({int(x) for x in rng.integers(1, M + 3, size=2)}) if M else [],
                    "reason": "because",
                })
    return pl.DataFrame(rows, schema_overrides={"cited_steps": pl.List(pl.Int32)})


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    assert run_draco("ingest", "openai-jsonl", str(SAMPLE), "--step-unit", "code-block",
                     "--code-language", "python",
                     "--tokenizer", "approx", "-o", str(d)).returncode == 0
    v = make_verdicts(pl.read_parquet(d / "steps.parquet"), pl.read_parquet(d / "rollouts.parquet"))
    write_table(v, d / "verdicts.parquet", VerdictAggregated)
    return d


def test_credit_compute_end_to_end(sample_run, tmp_path):
    d = sample_run
    out = tmp_path / "credit"
    res = run_draco("credit", "compute", "--rollouts", str(d / "rollouts.parquet"),
                    "--steps", str(d / "steps.parquet"), "--verdicts", str(d / "verdicts.parquet"),
                    "-o", str(out), "--tokens", "both")
    assert res.returncode == 0, res.stderr.decode()
    err = res.stdout.decode()  # results on stdout
    for words in ("groups / rollouts", "3 / 12", "criteria kept / dropped", "credit modes",
                  "advantage range", "mean pass rate (unfiltered)", "citations dropped"):
        assert words in err, err
    rewards = pl.read_parquet(out / "rewards.parquet")
    sc = pl.read_parquet(out / "step_credit.parquet")
    ta = pl.read_parquet(out / "token_advantages.parquet")
    assert rewards.height == 12 and ta.height == 12 and sc.height == 48
    # conservation through the files: Σ step totals = A·N per step-credited rollout
    j = sc.group_by("rollout_id").agg(pl.col("total").sum(), pl.col("n_tokens").sum()).join(
        rewards, on="rollout_id")
    step_mode = j.filter(pl.col("credit_mode") == "step")
    np.testing.assert_allclose(step_mode["total"], step_mode["advantage"] * step_mode["n_tokens"],
                               rtol=1e-9, atol=1e-9)
    # dense and spans in one file agree exactly
    from draco_cli.credit.tokens import spans_to_dense

    redone = spans_to_dense(ta.drop("advantages"))
    assert redone["advantages"].to_list() == ta["advantages"].to_list()
    assert pl.read_parquet_schema(out / "token_advantages.parquet")  # readable
    res = run_draco("validate", str(out))
    assert res.returncode == 0, res.stderr.decode()


def test_train_step_names_rollouts_that_do_not_say_theirs(sample_run, tmp_path):
    d = sample_run
    r = pl.read_parquet(d / "rollouts.parquet")
    # four rollouts say step 7, the rest do not say
    said = r.with_columns(pl.when(pl.int_range(pl.len()) < 4).then(7).otherwise(None)
                          .cast(pl.Int32).alias("train_step"))
    said.write_parquet(tmp_path / "rollouts.parquet")
    res = run_draco("credit", "compute", "--rollouts", str(tmp_path / "rollouts.parquet"),
                    "--steps", str(d / "steps.parquet"), "--verdicts", str(d / "verdicts.parquet"),
                    "--train-step", "5", "-o", str(tmp_path / "c"))
    assert res.returncode == 0, res.stderr.decode()
    ta = pl.read_parquet(tmp_path / "c" / "token_advantages.parquet").join(
        said.select("rollout_id", pl.col("train_step").alias("own")), on="rollout_id")
    assert ta.height == r.height
    assert (ta["train_step"] == ta["own"].fill_null(5)).all()
    res = run_draco("credit", "compute", "--rollouts", str(d / "rollouts.parquet"),
                    "--steps", str(d / "steps.parquet"), "--verdicts", str(d / "verdicts.parquet"),
                    "--train-step", "-1", "-o", str(tmp_path / "bad"))
    assert res.returncode == 2 and b"--train-step -1" in res.stderr, res.stderr


def test_expand_round_trip_cli(sample_run, tmp_path):
    d = sample_run
    out = tmp_path / "credit"
    assert run_draco("credit", "compute", "--rollouts", str(d / "rollouts.parquet"),
                     "--steps", str(d / "steps.parquet"), "--verdicts", str(d / "verdicts.parquet"),
                     "-o", str(out)).returncode == 0
    spans = out / "token_advantages.parquet"
    res = run_draco("credit", "expand", "--token-advantages", str(spans), "--rollouts",
                    str(d / "rollouts.parquet"), "-o", str(tmp_path / "dense.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    dense = pl.read_parquet(tmp_path / "dense.parquet")
    assert "advantages" in dense.columns and "span_start" not in dense.columns
    r = pl.read_parquet(d / "rollouts.parquet")
    assert dense.join(r, on="rollout_id").select(
        (pl.col("advantages").list.len() == pl.col("response_len")).all()).item()
    res = run_draco("credit", "expand", "--token-advantages", str(tmp_path / "dense.parquet"),
                    "-o", str(tmp_path / "spans2.parquet"))
    assert res.returncode == 0
    a, b = pl.read_parquet(spans), pl.read_parquet(tmp_path / "spans2.parquet")
    for c in ("rollout_id", "length", "span_start", "span_end", "span_value"):
        assert a[c].to_list() == b[c].to_list()


def test_judge_filter_cli_and_judge_narrowing(tmp_path):
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                     "-o", str(tmp_path)).returncode == 0
    r = pl.read_parquet(tmp_path / "rollouts.parquet")
    v = make_verdicts(pl.read_parquet(tmp_path / "steps.parquet"), r, judges=("frontier", "self"))
    write_table(v, tmp_path / "verdicts.parquet", VerdictAggregated)
    args = ["--rollouts", str(tmp_path / "rollouts.parquet"), "--verdicts",
            str(tmp_path / "verdicts.parquet")]
    res = run_draco("judge", "filter", *args, "-o", str(tmp_path / "f.parquet"))
    assert res.returncode == 2
    assert "several judges (frontier, self); choose one with --judge" in res.stderr.decode()
    res = run_draco("judge", "filter", *args, "--judge", "self", "-o", str(tmp_path / "f.parquet"))
    assert res.returncode == 0, res.stderr.decode()
    f = pl.read_parquet(tmp_path / "f.parquet")
    assert set(f["judge"]) == {"self"} and f["retained"].dtype == pl.Boolean
    # credit compute on a filtered file uses its retained flags as they are
    res = run_draco("credit", "compute", "--rollouts", str(tmp_path / "rollouts.parquet"),
                    "--steps", str(tmp_path / "steps.parquet"), "--verdicts",
                    str(tmp_path / "f.parquet"), "-o", str(tmp_path / "c"), "--tokens", "dense")
    assert res.returncode == 0, res.stderr.decode()
    assert "15 / 60" in res.stdout.decode()


def test_bad_inputs_name_file_row_field(sample_run, tmp_path):
    d = sample_run
    steps = pl.read_parquet(d / "steps.parquet")
    steps.with_columns(pl.when(pl.int_range(pl.len()) == 4).then(0).otherwise(pl.col("n_tokens"))
                       .alias("n_tokens")).write_parquet(tmp_path / "steps.parquet")
    res = run_draco("credit", "compute", "--rollouts", str(d / "rollouts.parquet"),
                    "--steps", str(tmp_path / "steps.parquet"), "--verdicts",
                    str(d / "verdicts.parquet"), "-o", str(tmp_path / "c"))
    assert res.returncode == 1
    assert "steps.parquet: row 4: field 'n_tokens': must be >= 1, got 0" in res.stderr.decode()
    v = pl.read_parquet(d / "verdicts.parquet")
    pl.concat([v, v.head(1)]).write_parquet(tmp_path / "verdicts.parquet")
    res = run_draco("credit", "compute", "--rollouts", str(d / "rollouts.parquet"),
                    "--steps", str(d / "steps.parquet"), "--verdicts",
                    str(tmp_path / "verdicts.parquet"), "-o", str(tmp_path / "c"))
    assert res.returncode == 1
    assert f"verdicts.parquet: row {v.height}: field '(rollout_id, criterion_id, judge)': duplicate key" \
        in res.stderr.decode()
