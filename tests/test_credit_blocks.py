"""``credit compute`` block by block (``credit/blocks.py``, also ``draco run``'s credit stage)
writes exactly what the whole-table computation writes: the same rows in the same order,
column types, table metadata and stats, under every option; inputs it cannot read in blocks go
the whole way; bad input in any block fails with the whole-table error, naming file, row and
field, publishing nothing.

Inputs are random (groups of 1 to 6 rollouts, rollouts with no step or no verdict, steps
without token_start laid end to end, rollouts without policy spans, unanswered verdicts,
citations out of range), in file order or shuffled so that a group's rows are far apart;
blocks as small as one group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draco_cli.credit import blocks as credit_blocks
from draco_cli.credit import compute as credit_ops
from draco_cli.credit import credit_compute
from draco_cli.errors import DracoError, InputError, OutputError
from draco_cli.io import SET_ID_KEY, BlockWriter, OutputSet
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



WHOLE = 10**12  # more rollouts a block than any input here: one block, the whole computation


@pytest.fixture
def blocks_used(monkeypatch):
    """Counts the computations the blocks finished (a fallback to the whole tables does not
    count)."""
    done = []
    real = credit_ops.credit_by_blocks

    def counting(plan, *args, **kwargs):
        stats = real(plan, *args, **kwargs)
        done.append(len(plan.blocks()))
        return stats

    monkeypatch.setattr(credit_ops, "credit_by_blocks", counting)
    return done


def compute(d: Path, out: Path, options: CreditOptions, block_rollouts: int, monkeypatch,
            verdicts: Path | None | str = "default"):
    monkeypatch.setattr(credit_blocks, "BLOCK_ROLLOUTS", block_rollouts)
    v = d / "verdicts.parquet" if verdicts == "default" else verdicts
    return credit_compute(d / "rollouts.parquet", d / "steps.parquet", v, out, options=options,
                          force=True)


def whole_and_blocks(d: Path, out: Path, options: CreditOptions, block_rollouts: int,
                     monkeypatch, verdicts: Path | None | str = "default"):
    whole = compute(d, out / "whole", options, WHOLE, monkeypatch, verdicts)
    blocks = compute(d, out / "blocks", options, block_rollouts, monkeypatch, verdicts)
    assert blocks == whole
    assert_same_outputs(out / "whole", out / "blocks")
    return whole


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("credit-blocks")
    return {shuffle: make_inputs(base / str(shuffle), groups=80, seed=11, shuffle=shuffle)
            for shuffle in (False, True)}


@pytest.mark.parametrize("block_rollouts", [1, 3, 10, 40])
def test_blocks_give_the_whole_tables(inputs, tmp_path, monkeypatch, blocks_used, block_rollouts):
    rollouts = pq.read_table(inputs[False] / "rollouts.parquet").num_rows
    assert rollouts > 40
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(), block_rollouts, monkeypatch)
    assert len(blocks_used) == 1 and blocks_used[0] > 1
    if block_rollouts == 1:  # a block per group
        groups = pq.read_table(inputs[False] / "rollouts.parquet")["group_id"]
        assert blocks_used[0] > len(set(groups.to_pylist())) * 0.9


@pytest.mark.parametrize("options", [
    CreditOptions(credit="uniform"),
    CreditOptions(estimator="rloo"),
    CreditOptions(std="population"),
    CreditOptions(std="none"),
    CreditOptions(drop="constant"),
    CreditOptions(reward="outcome"),
    CreditOptions(tokens="dense"),
    CreditOptions(tokens="both"),
    CreditOptions(judge="frontier"),
    CreditOptions(train_step=3),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.model_dump(exclude_defaults=True).items()))
def test_every_option(inputs, tmp_path, monkeypatch, blocks_used, options):
    whole_and_blocks(inputs[False], tmp_path, options, 8, monkeypatch)
    assert blocks_used and blocks_used[0] > 1


def test_no_verdicts_outcome_reward(inputs, tmp_path, monkeypatch, blocks_used):
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(reward="outcome", credit="uniform"),
                     8, monkeypatch, verdicts=None)
    assert blocks_used and blocks_used[0] > 1


def _with_verdicts(d: Path, tmp_path: Path, change) -> Path:
    new = tmp_path / "in"
    new.mkdir()
    for name in ("rollouts", "steps"):
        (new / f"{name}.parquet").write_bytes((d / f"{name}.parquet").read_bytes())
    pq.write_table(change(pq.read_table(d / "verdicts.parquet")), new / "verdicts.parquet")
    return new


@pytest.mark.parametrize("retained", ["set", "null"])
def test_retained_given(inputs, tmp_path, monkeypatch, blocks_used, retained):
    def add(t: pa.Table) -> pa.Table:
        rng = np.random.default_rng(3)
        col = (pa.array(rng.random(t.num_rows) < 0.7) if retained == "set"
               else pa.nulls(t.num_rows, pa.bool_()))
        return t.append_column("retained", col)

    d = _with_verdicts(inputs[False], tmp_path, add)
    whole_and_blocks(d, tmp_path / "out", CreditOptions(), 8, monkeypatch)
    assert blocks_used and blocks_used[0] > 1


def test_inputs_out_of_order_go_the_whole_way(inputs, tmp_path, monkeypatch, blocks_used):
    whole_and_blocks(inputs[True], tmp_path, CreditOptions(), 8, monkeypatch)
    assert blocks_used == []


@pytest.mark.parametrize("case", ["two judges", "retained in part", "groups apart"])
def test_what_only_the_whole_can_judge(inputs, tmp_path, monkeypatch, blocks_used, case):
    d = inputs[False]
    if case == "two judges":
        def change(t: pa.Table) -> pa.Table:
            judge = np.where(np.arange(t.num_rows) % 2 == 0, "frontier", "self")
            return t.set_column(t.column_names.index("judge"), "judge", pa.array(judge))
        d = _with_verdicts(d, tmp_path, change)
        options = CreditOptions(judge="frontier")
    elif case == "retained in part":
        def change(t: pa.Table) -> pa.Table:
            return t.append_column("retained", pa.array(
                [None if i % 3 == 0 else True for i in range(t.num_rows)], pa.bool_()))
        d = _with_verdicts(d, tmp_path, change)
        options = CreditOptions()
    else:  # a group's rollouts apart: rollouts reordered, steps and verdicts follow them
        new = tmp_path / "in"
        new.mkdir()
        r = pq.read_table(d / "rollouts.parquet")
        order = np.argsort(np.arange(r.num_rows) % 2, kind="stable")  # even rows first
        r = r.take(order)
        pq.write_table(r, new / "rollouts.parquet")
        for name in ("steps", "verdicts"):
            t = pq.read_table(d / f"{name}.parquet")
            pos = {rid: i for i, rid in enumerate(r["rollout_id"].to_pylist())}
            keys = np.array([pos[x] for x in t["rollout_id"].to_pylist()])
            pq.write_table(t.take(np.argsort(keys, kind="stable")), new / f"{name}.parquet")
        d, options = new, CreditOptions()
    whole_and_blocks(d, tmp_path / "out", options, 8, monkeypatch)
    assert blocks_used == []


def _bad(d: Path, tmp_path: Path, name: str, change) -> Path:
    new = tmp_path / "bad"
    new.mkdir()
    for n in ("rollouts", "steps", "verdicts"):
        t = pq.read_table(d / f"{n}.parquet")
        pq.write_table(change(t) if n == name else t, new / f"{n}.parquet")
    return new


def _late_row(t: pa.Table) -> int:
    return int(t.num_rows * 0.8)  # in a late block


BAD = {
    "step misnumbered": ("steps", lambda t: t.set_column(
        1, "step", pa.array(np.where(np.arange(t.num_rows) == _late_row(t), 99,
                                     t["step"].to_numpy()).astype(np.int32)))),
    "step past response_len": ("steps", lambda t: t.set_column(
        t.column_names.index("token_start"), "token_start", pa.array(
            np.where(np.arange(t.num_rows) == _late_row(t), 10**6,
                     t["token_start"].to_numpy(zero_copy_only=False)),
            mask=t["token_start"].is_null().to_numpy(zero_copy_only=False)).cast(pa.int32()))),
    "duplicate verdict": ("verdicts", lambda t: pa.concat_tables([
        t.slice(0, _late_row(t) + 1), t.slice(_late_row(t), 1),
        t.slice(_late_row(t) + 1)])),
    "verdict of unknown rollout": ("verdicts", lambda t: t.set_column(
        0, "rollout_id", pa.array(np.where(np.arange(t.num_rows) == _late_row(t), "nobody",
                                           t["rollout_id"].to_numpy(zero_copy_only=False))))),
    "negative n_tokens": ("steps", lambda t: t.set_column(
        t.column_names.index("n_tokens"), "n_tokens", pa.array(
            np.where(np.arange(t.num_rows) == _late_row(t), -1,
                     t["n_tokens"].to_numpy()).astype(np.int32)))),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_fails_as_the_whole(inputs, tmp_path, monkeypatch, case):
    name, change = BAD[case]
    d = _bad(inputs[False], tmp_path, name, change)
    errors = []
    for label, block_rollouts in (("whole", WHOLE), ("blocks", 8)):
        out = tmp_path / label
        with pytest.raises(DracoError) as err:
            compute(d, out, CreditOptions(), block_rollouts, monkeypatch)
        errors.append(str(err.value))
        assert not any((out / f"{t}.parquet").exists() for t in TABLES)  # nothing published
        assert not out.exists() or not [p for p in out.iterdir() if p.name != ".lock"]
    assert errors[0] == errors[1]


def test_a_wrong_layout_label_is_never_written(inputs, tmp_path, monkeypatch, blocks_used):
    """Were the label predicted before writing wrong, the whole computation writes the
    tables (and the right label)."""
    monkeypatch.setattr(credit_blocks, "_predicted_layout", lambda *a: "end_to_end")
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(), 8, monkeypatch)
    assert blocks_used == []


def test_predicted_layout_is_the_rows_layout(inputs, tmp_path, monkeypatch):
    for label, keep in (("positions", lambda t: t), ("end_to_end", lambda t: t.drop_columns(
            ["token_start"]))):
        d = tmp_path / label
        d.mkdir()
        for n in ("rollouts", "verdicts"):
            (d / f"{n}.parquet").write_bytes((inputs[False] / f"{n}.parquet").read_bytes())
        steps = pq.read_table(inputs[False] / "steps.parquet")
        r = pq.read_table(inputs[False] / "rollouts.parquet")
        if label == "positions":  # every step placed, every empty rollout with a length
            steps = steps.set_column(steps.column_names.index("token_start"), "token_start",
                                     pa.array(np.arange(steps.num_rows, dtype=np.int32) * 0))
            length = pa.array(np.full(r.num_rows, 10**6, dtype=np.int32))
        else:  # no step placed, no empty rollout with a length
            length = pa.nulls(r.num_rows, pa.int32())
        r = r.set_column(r.column_names.index("response_len"), "response_len", length)
        pq.write_table(r, d / "rollouts.parquet")
        pq.write_table(keep(steps), d / "steps.parquet")
        compute(d, tmp_path / f"out-{label}", CreditOptions(), 8, monkeypatch)
        meta = pq.read_schema(tmp_path / f"out-{label}" / "token_advantages.parquet").metadata
        assert meta[b"draco.token_layout"] == label.encode()


# --- the background writer ---------------------------------------------------------------


def test_block_writer_writes_blocks_in_order(tmp_path):
    blocks = [pa.table({"x": np.arange(i * 10, i * 10 + 10)}) for i in range(5)]
    with OutputSet(tmp_path / "o", ["a.parquet"]) as output, BlockWriter(output, depth=1) as w:
        for b in blocks:
            w.write("a.parquet", b)
    got = pq.read_table(tmp_path / "o" / "a.parquet")
    assert got["x"].to_pylist() == list(range(50))


def test_block_writer_error_publishes_nothing(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match="(?i)schema"):
        with OutputSet(out, ["a.parquet"]) as output, BlockWriter(output) as w:
            w.write("a.parquet", pa.table({"x": [1, 2]}))
            w.write("a.parquet", pa.table({"y": ["a"]}))  # another schema: the writer fails
    assert not out.exists() or not (out / "a.parquet").exists()


def test_block_writer_os_error_names_the_output(tmp_path):
    import shutil

    out = tmp_path / "o"
    with pytest.raises(OutputError, match="a.parquet"):
        with OutputSet(out, ["a.parquet"]) as output, BlockWriter(output) as w:
            assert output.staging is not None
            shutil.rmtree(output.staging)  # the staging folder vanishes under the writer
            w.write("a.parquet", pa.table({"x": [1]}))
    assert not (out / "a.parquet").exists()


@pytest.mark.parametrize("seed", range(6))
def test_random_inputs_and_blocks(tmp_path, monkeypatch, blocks_used, seed):
    """Other shapes, self-check columns (train_step, response_fingerprint with nulls) and
    block sizes drawn at random: blocks and whole agree."""
    rng = np.random.default_rng(100 + seed)
    d = make_inputs(tmp_path / "in", groups=int(rng.integers(10, 40)), seed=seed)
    r = pq.read_table(d / "rollouts.parquet")
    fp = np.char.add("fp", np.arange(r.num_rows).astype(str))
    r = r.append_column("train_step", pa.array(np.full(r.num_rows, seed, dtype=np.int32)))
    r = r.append_column("response_fingerprint",
                        pa.array(fp, mask=rng.random(r.num_rows) < 0.3))
    pq.write_table(r, d / "rollouts.parquet")
    rollouts = pq.read_table(d / "rollouts.parquet").num_rows
    options = CreditOptions(tokens=str(rng.choice(["spans", "dense", "both"])),
                            credit=str(rng.choice(["step", "uniform"])))
    whole_and_blocks(d, tmp_path / "out", options, int(rng.integers(1, max(2, rollouts // 3))),
                     monkeypatch)
    assert blocks_used and blocks_used[0] > 1


from tests.test_run import SAMPLE_RA, SAMPLE_SA, run_sample, server  # noqa: E402,F401


def test_real_rollouts_judged(server, tmp_path, monkeypatch, blocks_used):  # noqa: F811
    """The sample AppWorld rollouts, judged through ``draco run`` against the local protocol
    server: blocks of one group or two agree with the whole tables."""
    assert run_sample(server, tmp_path / "run").returncode == 0
    d = tmp_path / "in"
    d.mkdir()
    for name, src in (("rollouts", SAMPLE_RA), ("steps", SAMPLE_SA),
                      ("verdicts", tmp_path / "run" / "judge" / "verdicts.parquet")):
        (d / f"{name}.parquet").write_bytes(Path(src).read_bytes())
    for block_rollouts in (1, 4):
        whole_and_blocks(d, tmp_path / f"out{block_rollouts}", CreditOptions(), block_rollouts,
                         monkeypatch)
    assert len(blocks_used) == 2 and min(blocks_used) > 1


# --- from the chunked credit stage of ``draco run``, now the blocks ----------------------


def test_one_layout_stays_named(tmp_path, monkeypatch, blocks_used):
    """Every rollout laid out by position: the blocks' table says so, as the whole one does."""
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
    whole_and_blocks(d, tmp_path / "out", CreditOptions(), 6, monkeypatch)
    assert blocks_used and blocks_used[0] > 1
    meta = pq.read_schema(tmp_path / "out" / "blocks" / "token_advantages.parquet").metadata
    assert meta[b"draco.token_layout"] == b"positions"


def test_retained_null_in_part_is_decided_over_the_whole(inputs, tmp_path, monkeypatch,
                                                         blocks_used):
    """``retained`` null throughout is computed, null in part filled with false: a block whose
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
    whole_and_blocks(d, tmp_path / "out", CreditOptions(), 6, monkeypatch)
    assert blocks_used == []


def _broken(src: Path, dst: Path, name: str, edit) -> Path:
    dst.mkdir()
    for t in ("rollouts", "steps", "verdicts"):
        df = pl.read_parquet(src / f"{t}.parquet")
        (edit(df) if t == name else df).write_parquet(dst / f"{t}.parquet")
    return dst


BROKEN = {
    # a duplicate rollout id in another group (another block)
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
    # the first group's verdicts by another judge: with a block per group, each block sees
    # one judge and only the whole file shows two
    "two judges": ("verdicts", lambda df: df.with_columns(
        pl.when(pl.col("rollout_id").is_in(FIRST_GROUP)).then(pl.lit("self"))
        .otherwise(pl.col("judge")).alias("judge"))),
}
FIRST_GROUP: list[str] = []


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("shuffle", [False, True])
def test_errors_name_the_original_rows(inputs, tmp_path, monkeypatch, case, shuffle):
    name, edit = BROKEN[case]
    r = pl.read_parquet(inputs[shuffle] / "rollouts.parquet")
    FIRST_GROUP[:] = r.filter(pl.col("group_id") == "g0")["rollout_id"].to_list()
    d = _broken(inputs[shuffle], tmp_path / "in", name, edit)
    errors = []
    for label, block_rollouts in (("whole", WHOLE), ("blocks", 1 if case == "two judges" else 6)):
        with pytest.raises(DracoError) as err:
            compute(d, tmp_path / label, CreditOptions(), block_rollouts, monkeypatch)
        errors.append(err.value)
        assert not (tmp_path / label).exists() or not [
            p for p in (tmp_path / label).iterdir() if p.name != ".lock"]  # nothing published
    assert type(errors[1]) is type(errors[0]) and str(errors[1]) == str(errors[0])
    if isinstance(errors[0], InputError):
        assert errors[0].file is not None and str(d) in errors[0].file


def test_few_rollouts_take_the_whole_path(inputs, tmp_path, monkeypatch, blocks_used):
    rollouts = pq.read_table(inputs[False] / "rollouts.parquet").num_rows
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(), rollouts, monkeypatch)
    assert blocks_used == []


def test_draco_run_credit_by_blocks(inputs, tmp_path, monkeypatch, blocks_used):
    """``draco run`` (the outcome setting: no LLM) computes credit by blocks and writes the
    whole-table outputs and stats."""
    from draco_cli.run import pipeline
    from draco_cli.run.pipeline import RunOptions, run_step

    monkeypatch.setattr(pipeline, "RUN_CREDIT_BLOCK_ROLLOUTS", 10)
    d = inputs[False]
    res = run_step(d / "rollouts.parquet", d / "steps.parquet", tmp_path / "run", None,
                   RunOptions.for_setting("outcome"))
    assert blocks_used and blocks_used[0] > 1
    opts = RunOptions.for_setting("outcome").credit
    whole = compute(d, tmp_path / "whole", opts, WHOLE, monkeypatch, verdicts=None)
    assert res.manifest["stages"]["credit"]["stats"] == whole.__dict__
    assert_same_outputs(tmp_path / "whole", tmp_path / "run" / "credit")


def test_a_block_that_fails_on_its_own_falls_back_to_the_whole(inputs, tmp_path, monkeypatch,
                                                               blocks_used):
    """Any error a block raises sends the computation to the whole tables (which, here,
    succeed): the tables are still the whole ones."""
    calls = []
    real = credit_blocks.compute_credit

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise InputError("block trouble", file="x")
        return real(*args, **kwargs)

    monkeypatch.setattr(credit_blocks, "compute_credit", flaky)
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(), 8, monkeypatch)
    assert blocks_used == [] and len(calls) == 2
