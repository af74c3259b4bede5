"""The credit stage of ``draco run`` by chunks of whole groups (``ops/credit_chunks.py``)
writes exactly what the whole-table ``credit_compute`` writes: the same rows in the same
order, the same column types and table metadata, the same stats; and bad input fails with the
whole-table error, naming the original file and row, publishing nothing.

Inputs are random (groups of 1 to 6 rollouts, rollouts with no step or no verdict, steps
without token_start laid end to end, rollouts without policy spans, unanswered verdicts,
citations out of range), in file order or shuffled so that a group's rows are far apart, and
cut into chunks as small as one group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draco_cli.errors import DracoError, InputError
from draco_cli.io import SET_ID_KEY
from draco_cli.ops import credit as credit_ops
from draco_cli.ops import credit_chunks
from draco_cli.ops.credit import credit_compute
from draco_cli.ops.credit_chunks import WORK_PREFIX, credit_by_groups
from draco_cli.options import CreditOptions

TABLES = ("rewards", "step_credit", "token_advantages")


def _lists(offsets: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                    pa.array(values, type=type_))


def make_inputs(folder: Path, groups: int, seed: int, shuffle: bool = False) -> Path:
    """rollouts / steps / verdicts Parquet files in ``folder`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    size = rng.integers(1, 7, size=groups)
    n = int(size.sum())
    group = np.repeat(np.arange(groups), size)
    ids = np.char.add("r", np.arange(n).astype(str))
    gids = np.char.add("g", group.astype(str))
    m = rng.integers(0, 6, size=n)                      # steps per rollout, some none
    total = int(m.sum())
    step_row = np.repeat(np.arange(n), m)
    first = np.cumsum(m) - m
    step_no = (np.arange(total) - first[step_row] + 1).astype(np.int32)
    n_tok = rng.integers(1, 40, size=total).astype(np.int32)
    gap, obs = 3, 5
    span_len = gap + n_tok + obs
    cum = np.cumsum(span_len) - span_len
    token_start = (cum - np.append(cum, 0)[first][step_row] + gap).astype(np.int32)
    ends = np.zeros(n, dtype=np.int64)
    np.add.at(ends, step_row, span_len)
    positioned = rng.random(n) < 0.8                    # the others: steps end to end
    spans = np.stack([token_start - gap, token_start + n_tok], axis=1).astype(np.int32)
    inner = _lists(np.arange(total + 1) * 2, spans.ravel(), pa.int32())
    policy = pa.ListArray.from_arrays(pa.array(np.append(first, total).astype(np.int32)), inner,
                                      mask=pa.array(~positioned))
    rollouts = pa.table({
        "rollout_id": ids, "group_id": gids, "task_id": gids,
        "instruction": pa.array(np.full(n, "do it")),
        "outcome": rng.integers(0, 2, size=n).astype(np.float64),
        "n_turns": m.astype(np.int32),
        "response_len": pa.array(ends.astype(np.int32), mask=~positioned),
        "policy_spans": policy,
    })
    steps = pa.table({
        "rollout_id": ids[step_row], "step": step_no,
        "action": pa.array(np.full(total, "a")), "observation": pa.array(np.full(total, "o")),
        "n_tokens": n_tok,
        "token_start": pa.array(token_start, mask=~positioned[step_row]),
    })
    crit = 4
    judged = np.flatnonzero(rng.random(n) < 0.9)        # some rollouts have no verdict
    v_row = np.repeat(judged, crit)
    nv = v_row.size
    k = rng.integers(0, 4, size=nv)
    # steps 1..M+1: some citations fall outside 1..M and are dropped
    cites = (rng.random(int(k.sum())) * (m[np.repeat(v_row, k)] + 1)).astype(np.int32) + 1
    verdict = rng.choice(np.array(["pass", "fail", "na", ""]), size=nv, p=[0.5, 0.3, 0.1, 0.1])
    verdicts = pa.table({
        "rollout_id": ids[v_row],
        "criterion_id": np.char.add("c", np.tile(np.arange(crit), judged.size).astype(str)),
        "judge": pa.array(np.full(nv, "frontier")),
        "verdict": pa.array(verdict, mask=verdict == ""),
        "cited_steps": _lists(np.append(0, np.cumsum(k)), cites, pa.int32()),
        "reason": pa.array(np.full(nv, "why")),
    })
    folder.mkdir(parents=True, exist_ok=True)
    for name, t in (("rollouts", rollouts), ("steps", steps), ("verdicts", verdicts)):
        if shuffle:
            t = t.take(rng.permutation(t.num_rows))
        pq.write_table(t, folder / f"{name}.parquet")
    return folder


def assert_same_outputs(a: Path, b: Path) -> None:
    for name in TABLES:
        x, y = pq.read_table(a / f"{name}.parquet"), pq.read_table(b / f"{name}.parquet")
        assert x.schema.equals(y.schema, check_metadata=False), name
        # the table metadata but the output set's own id (new for every set written)
        meta = [{k: v for k, v in t.schema.metadata.items() if k != SET_ID_KEY.encode()}
                for t in (x, y)]
        assert meta[0] == meta[1], name
        assert x.num_rows == y.num_rows and pl.from_arrow(x).equals(pl.from_arrow(y)), name


def whole_and_chunked(d: Path, out: Path, chunk: int, options: CreditOptions,
                      verdicts: bool = True) -> int:
    v = d / "verdicts.parquet" if verdicts else None
    whole = credit_compute(d / "rollouts.parquet", d / "steps.parquet", v, out / "whole",
                           options=options, force=True)
    stats, chunks = credit_by_groups(d / "rollouts.parquet", d / "steps.parquet", v,
                                     out / "chunked", options=options, chunk_rollouts=chunk)
    assert stats == whole
    assert_same_outputs(out / "whole", out / "chunked")
    assert not list(out.glob(WORK_PREFIX + "*"))      # the chunks' files are gone
    return chunks


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("credit-chunks")
    return {shuffle: make_inputs(base / str(shuffle), groups=60, seed=5, shuffle=shuffle)
            for shuffle in (False, True)}


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 13, 64])
def test_chunks_give_the_whole_tables(inputs, tmp_path, shuffle, chunk):
    d = inputs[shuffle]
    rollouts = pq.read_table(d / "rollouts.parquet")
    assert rollouts.num_rows > 64
    # shuffled: the groups' rows are not next to each other
    assert shuffle == (not pl.from_arrow(rollouts)["group_id"].str.slice(1).cast(int).is_sorted())
    chunks = whole_and_chunked(d, tmp_path, chunk, CreditOptions())
    assert chunks > 1
    # a chunk of one group at chunk size 1
    if chunk == 1:
        assert chunks == pl.from_arrow(rollouts)["group_id"].n_unique()
    modes = pl.read_parquet(tmp_path / "chunked" / "rewards.parquet")["credit_mode"]
    assert set(modes) == {"step", "grpo_fallback"}
    layouts = pq.read_schema(tmp_path / "chunked" / "token_advantages.parquet").metadata
    assert layouts[b"draco.token_layout"] == b"mixed"


@pytest.mark.parametrize("options", [
    {"credit": "uniform"}, {"estimator": "rloo"}, {"std": "population", "drop": "constant"},
    {"tokens": "dense"}, {"tokens": "both"}, {"reward": "outcome"}, {"judge": "frontier"}])
def test_chunks_give_the_whole_tables_under_each_option(inputs, tmp_path, options):
    assert whole_and_chunked(inputs[True], tmp_path, 9, CreditOptions(**options)) > 1


def test_without_verdicts(inputs, tmp_path):
    opts = CreditOptions(reward="outcome", credit="uniform")
    assert whole_and_chunked(inputs[True], tmp_path, 9, opts, verdicts=False) > 1


def test_one_layout_stays_named(tmp_path):
    """Every rollout laid out by position: the merged table says so, as the whole one does."""
    d = make_inputs(tmp_path / "in", groups=30, seed=2)
    r = pq.read_table(d / "rollouts.parquet")
    s = pq.read_table(d / "steps.parquet")
    # give every step a position and every rollout a length: one layout
    starts = pl.from_arrow(s).with_columns(
        (pl.col("n_tokens") + 8).cum_sum().over("rollout_id").alias("e"))
    starts = starts.with_columns((pl.col("e") - pl.col("n_tokens") - 5).alias("token_start"))
    pq.write_table(starts.drop("e").to_arrow(), d / "steps.parquet")
    lens = starts.group_by("rollout_id").agg(pl.col("e").max())
    r2 = pl.from_arrow(r).drop("policy_spans").join(lens, on="rollout_id", how="left",
                                                    maintain_order="left")
    r2 = r2.with_columns(pl.col("e").fill_null(0).cast(pl.Int32).alias("response_len")).drop("e")
    pq.write_table(r2.to_arrow(), d / "rollouts.parquet")
    assert whole_and_chunked(d, tmp_path, 5, CreditOptions()) > 1
    meta = pq.read_schema(tmp_path / "chunked" / "token_advantages.parquet").metadata
    assert meta[b"draco.token_layout"] != b"mixed"


def test_retained_null_in_part_is_decided_over_the_whole(inputs, tmp_path):
    """``retained`` null throughout is computed, null in part filled with false: a chunk whose
    verdicts are all null must not compute what the whole fills."""
    d = tmp_path / "in"
    d.mkdir()
    for name in ("rollouts", "steps"):
        (d / f"{name}.parquet").write_bytes((inputs[False] / f"{name}.parquet").read_bytes())
    v = pl.read_parquet(inputs[False] / "verdicts.parquet")
    first_groups = pl.read_parquet(d / "rollouts.parquet").head(40)["rollout_id"]
    v = v.with_columns(pl.when(pl.col("rollout_id").is_in(first_groups.implode()))
                       .then(None).otherwise(pl.col("verdict") == "fail").alias("retained"))
    v.write_parquet(d / "verdicts.parquet")
    whole_and_chunked(d, tmp_path, 4, CreditOptions())


def _broken(src: Path, dst: Path, name: str, edit) -> Path:
    dst.mkdir()
    for t in ("rollouts", "steps", "verdicts"):
        df = pl.read_parquet(src / f"{t}.parquet")
        (edit(df) if t == name else df).write_parquet(dst / f"{t}.parquet")
    return dst


def _last_rollout(df: pl.DataFrame) -> str:
    return str(df["rollout_id"][-1])


BROKEN = {
    # a duplicate rollout id in another group (another chunk)
    "duplicate id": ("rollouts", lambda df: df.with_columns(
        pl.when(pl.int_range(pl.len()) == pl.len() - 1).then(pl.lit("r0"))
        .otherwise(pl.col("rollout_id")).alias("rollout_id"))),
    "unknown rollout of a step": ("steps", lambda df: df.with_columns(
        pl.when(pl.int_range(pl.len()) == pl.len() - 3).then(pl.lit("nobody"))
        .otherwise(pl.col("rollout_id")).alias("rollout_id"))),
    "unknown rollout of a verdict": ("verdicts", lambda df: df.with_columns(
        pl.when(pl.int_range(pl.len()) == pl.len() - 2).then(pl.lit("nobody"))
        .otherwise(pl.col("rollout_id")).alias("rollout_id"))),
    "steps not 1..M, late in the file": ("steps", lambda df: df.with_columns(
        pl.when(pl.int_range(pl.len()) == pl.len() - 1).then(pl.col("step") + 1)
        .otherwise(pl.col("step")).alias("step"))),
    "a bad value late in the rollouts": ("rollouts", lambda df: df.with_columns(
        pl.when(pl.int_range(pl.len()) == pl.len() - 5).then(float("nan"))
        .otherwise(pl.col("outcome")).alias("outcome"))),
    "a step with no tokens": ("steps", lambda df: df.with_columns(
        pl.when(pl.int_range(pl.len()) == pl.len() - 4).then(0)
        .otherwise(pl.col("n_tokens")).cast(pl.Int32).alias("n_tokens"))),
    "steps without rollout_id": ("steps", lambda df: df.drop("rollout_id")),
    "steps without n_tokens": ("steps", lambda df: df.drop("n_tokens")),
    "a repeated verdict": ("verdicts", lambda df: pl.concat([df, df.tail(1)])),
    # the first group's verdicts by another judge: with a chunk per group, each chunk sees one
    # judge and only the whole file shows two
    "two judges": ("verdicts", lambda df: df.with_columns(
        pl.when(pl.col("rollout_id").is_in(FIRST_GROUP)).then(pl.lit("self"))
        .otherwise(pl.col("judge")).alias("judge"))),
}
FIRST_GROUP: list[str] = []


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("shuffle", [False, True])
def test_errors_name_the_original_rows(inputs, tmp_path, case, shuffle):
    name, edit = BROKEN[case]
    r = pl.read_parquet(inputs[shuffle] / "rollouts.parquet")
    FIRST_GROUP[:] = r.filter(pl.col("group_id") == "g0")["rollout_id"].to_list()
    d = _broken(inputs[shuffle], tmp_path / "in", name, edit)
    with pytest.raises(DracoError) as whole:
        credit_compute(d / "rollouts.parquet", d / "steps.parquet", d / "verdicts.parquet",
                       tmp_path / "whole", options=CreditOptions(), force=True)
    with pytest.raises(DracoError) as chunked:
        credit_by_groups(d / "rollouts.parquet", d / "steps.parquet", d / "verdicts.parquet",
                         tmp_path / "chunked", options=CreditOptions(),
                         chunk_rollouts=1 if case == "two judges" else 4)
    assert type(chunked.value) is type(whole.value)
    assert str(chunked.value) == str(whole.value)
    if isinstance(whole.value, InputError):
        assert whole.value.file is not None and str(d) in whole.value.file
    assert not (tmp_path / "chunked").exists()          # nothing published
    assert not list(tmp_path.glob(WORK_PREFIX + "*"))


def test_a_killed_runs_chunk_files_are_removed(inputs, tmp_path):
    stale = tmp_path / (WORK_PREFIX + "old")
    (stale / "chunk-00000").mkdir(parents=True)
    whole_and_chunked(inputs[False], tmp_path, 16, CreditOptions())
    assert not stale.exists()


def test_few_rollouts_take_the_whole_path(inputs, tmp_path):
    assert whole_and_chunked(inputs[False], tmp_path, 10_000, CreditOptions()) == 1


def test_draco_run_credit_by_chunks(inputs, tmp_path, monkeypatch):
    """``draco run`` (the outcome setting: no LLM) computes credit by chunks and writes the
    whole-table outputs."""
    from draco_cli.ops.run import RunOptions, run_step

    seen = []
    real = credit_chunks.credit_by_groups

    def spy(*args, **kwargs):
        stats, chunks = real(*args, **kwargs)
        seen.append(chunks)
        return stats, chunks

    monkeypatch.setattr(credit_chunks, "CHUNK_ROLLOUTS", 8)
    monkeypatch.setattr(credit_chunks, "credit_by_groups", spy)
    d = inputs[True]
    res = run_step(d / "rollouts.parquet", d / "steps.parquet", tmp_path / "run", None,
                   RunOptions.for_setting("outcome"))
    assert seen and seen[0] > 1
    opts = RunOptions.for_setting("outcome").credit
    whole = credit_compute(d / "rollouts.parquet", d / "steps.parquet", None, tmp_path / "whole",
                           options=opts)
    assert res.manifest["stages"]["credit"]["stats"] == whole.__dict__
    assert_same_outputs(tmp_path / "whole", tmp_path / "run" / "credit")
    assert not list((tmp_path / "run").glob(WORK_PREFIX + "*"))


def test_a_chunk_that_fails_on_its_own_falls_back_to_the_whole(inputs, tmp_path, monkeypatch):
    """Any error a chunk raises sends the computation to the whole tables (which, here,
    succeed): the tables are still the whole ones."""
    calls = []
    real = credit_ops.credit_compute

    def flaky(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise InputError("chunk trouble", file=str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(credit_ops, "credit_compute", flaky)
    assert whole_and_chunked(inputs[False], tmp_path, 16, CreditOptions()) == 1
    assert calls[-1] == inputs[False] / "rollouts.parquet"
