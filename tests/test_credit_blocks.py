"""``credit compute`` block by block (``ops/credit_blocks.py``) writes exactly what the
whole-table computation writes: the same rows in the same order, column types, table metadata
and stats, under every option; inputs it cannot cut into slices go the whole way; bad input in
any block fails with the whole-table error, naming file, row and field, publishing nothing.

Inputs come from ``test_run_credit_chunks.make_inputs`` (groups of 1 to 6 rollouts, rollouts
with no step or no verdict, steps without token_start laid end to end, rollouts without policy
spans, unanswered verdicts, citations out of range); blocks as small as one group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draco_cli.errors import DracoError, OutputError
from draco_cli.io import BlockWriter, OutputSet
from draco_cli.ops import credit as credit_ops
from draco_cli.ops import credit_blocks
from draco_cli.ops.credit import credit_compute
from draco_cli.options import CreditOptions
from tests.test_run_credit_chunks import TABLES, assert_same_outputs, make_inputs

WHOLE = 10**12  # more steps a block than any input here: one block, the whole computation


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


def compute(d: Path, out: Path, options: CreditOptions, block_steps: int, monkeypatch,
            verdicts: Path | None | str = "default"):
    monkeypatch.setattr(credit_blocks, "BLOCK_STEPS", block_steps)
    v = d / "verdicts.parquet" if verdicts == "default" else verdicts
    return credit_compute(d / "rollouts.parquet", d / "steps.parquet", v, out, options=options,
                          force=True)


def whole_and_blocks(d: Path, out: Path, options: CreditOptions, block_steps: int,
                     monkeypatch, verdicts: Path | None | str = "default"):
    whole = compute(d, out / "whole", options, WHOLE, monkeypatch, verdicts)
    blocks = compute(d, out / "blocks", options, block_steps, monkeypatch, verdicts)
    assert blocks == whole
    assert_same_outputs(out / "whole", out / "blocks")
    return whole


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("credit-blocks")
    return {shuffle: make_inputs(base / str(shuffle), groups=80, seed=11, shuffle=shuffle)
            for shuffle in (False, True)}


@pytest.mark.parametrize("block_steps", [1, 7, 50, 200])
def test_blocks_give_the_whole_tables(inputs, tmp_path, monkeypatch, blocks_used, block_steps):
    steps = pq.read_table(inputs[False] / "steps.parquet").num_rows
    assert steps > 200
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(), block_steps, monkeypatch)
    assert len(blocks_used) == 1 and blocks_used[0] > 1
    if block_steps == 1:  # a block per group (groups without steps share one)
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
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.model_dump(exclude_defaults=True).items()))
def test_every_option(inputs, tmp_path, monkeypatch, blocks_used, options):
    whole_and_blocks(inputs[False], tmp_path, options, 30, monkeypatch)
    assert blocks_used and blocks_used[0] > 1


def test_no_verdicts_outcome_reward(inputs, tmp_path, monkeypatch, blocks_used):
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(reward="outcome", credit="uniform"),
                     30, monkeypatch, verdicts=None)
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
    whole_and_blocks(d, tmp_path / "out", CreditOptions(), 30, monkeypatch)
    assert blocks_used and blocks_used[0] > 1


def test_inputs_out_of_order_go_the_whole_way(inputs, tmp_path, monkeypatch, blocks_used):
    whole_and_blocks(inputs[True], tmp_path, CreditOptions(), 30, monkeypatch)
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
    whole_and_blocks(d, tmp_path / "out", options, 30, monkeypatch)
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
    for label, block_steps in (("whole", WHOLE), ("blocks", 30)):
        out = tmp_path / label
        with pytest.raises(DracoError) as err:
            compute(d, out, CreditOptions(), block_steps, monkeypatch)
        errors.append(str(err.value))
        assert not any((out / f"{t}.parquet").exists() for t in TABLES)  # nothing published
        assert not out.exists() or not [p for p in out.iterdir() if p.name != ".lock"]
    assert errors[0] == errors[1]


def test_a_wrong_layout_label_is_never_written(inputs, tmp_path, monkeypatch, blocks_used):
    """Were the label predicted before writing wrong, the whole computation writes the
    tables (and the right label)."""
    monkeypatch.setattr(credit_blocks, "_predicted_layout", lambda *a: "end_to_end")
    whole_and_blocks(inputs[False], tmp_path, CreditOptions(), 30, monkeypatch)
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
        compute(d, tmp_path / f"out-{label}", CreditOptions(), 30, monkeypatch)
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
    steps = pq.read_table(d / "steps.parquet").num_rows
    options = CreditOptions(tokens=str(rng.choice(["spans", "dense", "both"])),
                            credit=str(rng.choice(["step", "uniform"])))
    whole_and_blocks(d, tmp_path / "out", options, int(rng.integers(1, max(2, steps // 3))),
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
    for block_steps in (1, 20):
        whole_and_blocks(d, tmp_path / f"out{block_steps}", CreditOptions(), block_steps,
                         monkeypatch)
    assert len(blocks_used) == 2 and min(blocks_used) > 1
