"""draco_cli.trainers.loader on arrays shaped as verl, TRL and OpenRLHF shape them."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import polars as pl
import pytest

from draco_cli.io import write_table
from draco_cli.schemas import TokenAdvantages
from draco_cli.credit.tokens import spans_to_dense
from draco_cli.trainers.loader import (
    AlignmentError,
    fingerprint,
    group_rollout_ids,
    load_token_advantages,
)


@pytest.fixture
def table(tmp_path):
    spans = pl.DataFrame({
        "rollout_id": ["u1:0", "u1:1", "u2:0"], "length": [6, 4, 3],
        "layout": ["positions"] * 3,
        "span_start": [[1, 4], [0], []], "span_end": [[3, 5], [2], []],
        "span_value": [[0.5, -1.0], [2.0], []],
    }, schema_overrides={"length": pl.Int32, "span_start": pl.List(pl.Int32),
                         "span_end": pl.List(pl.Int32), "span_value": pl.List(pl.Float32)})
    write_table(spans, tmp_path / "spans.parquet", TokenAdvantages, drop_absent_optional=True)
    write_table(spans_to_dense(spans), tmp_path / "dense.parquet", TokenAdvantages,
                drop_absent_optional=True)
    return tmp_path


@pytest.mark.parametrize("form", ["spans", "dense"])
def test_verl_batch_keyed_by_uid(table, form):
    t = load_token_advantages(table / f"{form}.parquet")
    # verl: non_tensor_batch["uid"] is an object array, one group id per row, rows of a group
    # in rollout order; response_mask is [bs, response_length], right-padded.
    uid = np.array(["u1", "u2", "u1"], dtype=object)
    with pytest.warns(UserWarning, match="batch order"):  # valid only while order holds
        ids = group_rollout_ids(uid)
    assert ids == ["u1:0", "u2:0", "u1:1"]
    mask = np.array([[1, 1, 1, 0, 1, 1, 0, 0],
                     [1, 1, 1, 0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 0, 0, 0, 0]], dtype=np.int64)
    adv = t.batch(ids, mask)
    assert adv.dtype == np.float32 and adv.shape == (3, 8)
    np.testing.assert_array_equal(adv[0], [0, 0.5, 0.5, 0, -1.0, 0, 0, 0])
    np.testing.assert_array_equal(adv[1], np.zeros(8))
    np.testing.assert_array_equal(adv[2], [2.0, 2.0, 0, 0, 0, 0, 0, 0])


def test_trl_and_openrlhf_shapes(table):
    t = load_token_advantages(table / "spans.parquet", rollout_ids=["u1:0"])
    assert len(t) == 1
    # TRL completion_mask / OpenRLHF action_mask: [B, max_completion_len], right-padded
    completion_mask = np.ones((1, 5), dtype=np.int32)
    adv = t.batch(["u1:0"], completion_mask)
    np.testing.assert_array_equal(adv[0], [0, 0.5, 0.5, 0, -1.0])


def test_several_files_filtered_by_a_generator_of_ids(table):
    # the ids are read once, not once per file: a generator is used up by the first
    spans = pl.read_parquet(table / "spans.parquet")
    spans.filter(pl.col("rollout_id") == "u2:0").write_parquet(table / "step2.parquet")
    spans.filter(pl.col("rollout_id") != "u2:0").write_parquet(table / "step1.parquet")
    t = load_token_advantages([table / "step1.parquet", table / "step2.parquet"],
                              rollout_ids=(r for r in ["u1:1", "u2:0"]))
    assert len(t) == 2 and "u1:1" in t and "u2:0" in t


def test_misalignment_is_caught(table):
    t = load_token_advantages(table / "spans.parquet")
    with pytest.raises(AlignmentError, match="past the trainer's 4 response tokens"):
        t.batch(["u1:0"], length=4)
    with pytest.raises(AlignmentError, match="the response mask excludes"):
        t.batch(["u1:0"], np.array([[1, 0, 1, 1, 1, 1]]))
    with pytest.raises(AlignmentError, match="no token advantages for rollout 'nope'"):
        t.batch(["nope"], length=4)
    # non-strict: cut and masked silently
    adv = t.batch(["u1:0"], np.array([[1, 0, 1, 1]]), strict=False)
    np.testing.assert_array_equal(adv[0], [0, 0, 0.5, 0])


def test_trainer_module_imports_no_torch_and_no_polars():
    code = ("import sys, draco_cli.trainers.loader; "
            "print(any(m in sys.modules for m in ('torch', 'polars', 'typer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# --- the self-checking file: per-row identity, counts, fingerprints, train step ------------

@pytest.fixture
def checked(tmp_path):
    """Two rollouts with equal masks (4 tokens each) and different token ids, from step 5."""
    ids = {"a": [11, 12, 13, 14], "b": [21, 22, 23, 24]}
    spans = pl.DataFrame({
        "rollout_id": ["a", "b"], "length": [4, 4], "layout": ["positions"] * 2,
        "span_start": [[0], [0]], "span_end": [[4], [4]], "span_value": [[1.5], [-0.5]],
        "train_step": [5, 5], "n_policy_tokens": [4, 4],
        "response_fingerprint": [fingerprint(ids["a"]), fingerprint(ids["b"])],
    }, schema_overrides={"length": pl.Int32, "span_start": pl.List(pl.Int32),
                         "span_end": pl.List(pl.Int32), "span_value": pl.List(pl.Float32),
                         "train_step": pl.Int32, "n_policy_tokens": pl.Int32})
    write_table(spans, tmp_path / "ta.parquet", TokenAdvantages, drop_absent_optional=True)
    return load_token_advantages(tmp_path / "ta.parquet"), ids


def test_swapped_pair_under_equal_masks_is_refused_by_the_fingerprint(checked):
    t, ids = checked
    mask = np.ones((2, 6), dtype=np.int64)
    mask[:, 4:] = 0
    resp = np.array([ids["a"] + [0, 0], ids["b"] + [0, 0]])
    adv = t.batch(["a", "b"], mask, response_ids=resp, train_step=5)
    np.testing.assert_array_equal(adv[:, :4], [[1.5] * 4, [-0.5] * 4])
    # Counts agree, strict mode finds nothing: only the fingerprint can tell.
    t.batch(["b", "a"], mask)
    with pytest.raises(AlignmentError, match=r"rollout 'b' \(trainer row 0\).*fingerprint"):
        t.batch(["b", "a"], mask, response_ids=resp)


def test_row_checks_name_rollout_and_trainer_row(checked):
    t, _ = checked
    mask = np.ones((2, 4), dtype=np.int64)
    with pytest.raises(AlignmentError, match=r"no token advantages for rollout 'zz'.*trainer row 1"):
        t.batch(["a", "zz"], mask)
    with pytest.raises(AlignmentError, match=r"rollout 'b' \(trainer row 1\): the file is from "
                                             r"train step 5, the row from step 6"):
        t.batch(["a", "b"], mask, train_step=[5, 6])
    short = mask.copy()
    short[1, 3] = 0
    with pytest.raises(AlignmentError, match=r"rollout 'b' \(trainer row 1\): the response mask "
                                             r"marks 3 policy tokens, the file expects 4"):
        t.batch(["a", "b"], short)
    with pytest.raises(AlignmentError, match="trainer row 1 carries no rollout id"):
        t.batch(["a", None], mask)


def test_padding_rows_get_zeros_only_when_marked(checked):
    t, _ = checked
    mask = np.ones((3, 4), dtype=np.int64)
    with pytest.raises(AlignmentError, match="pad0"):
        t.batch(["a", "pad0", "b"], mask)
    adv = t.batch(["a", "pad0", "b"], mask, padding=[False, True, False])
    np.testing.assert_array_equal(adv[1], np.zeros(4))
    np.testing.assert_array_equal(adv[2], [-0.5] * 4)


def test_file_without_train_step_refuses_a_claimed_step(table):
    t = load_token_advantages(table / "spans.parquet")
    with pytest.raises(AlignmentError, match="records no train_step"):
        t.batch(["u1:0"], length=6, train_step=3)


def test_group_rollout_ids_warns_that_order_must_hold():
    with pytest.warns(UserWarning, match="batch order"):
        assert group_rollout_ids(["u", "u"]) == ["u:0", "u:1"]


def test_integrations_import_no_torch():
    code = ("import sys, draco_cli, draco_cli.trainers.verl, draco_cli.trainers.trl, "
            "draco_cli.trainers.openrlhf; "
            "print(any(m in sys.modules for m in ('torch', 'verl', 'trl', 'openrlhf', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_trl_ids_count_the_group_index_across_processes():
    from draco_cli.trainers.trl import rollout_ids

    # 2 processes, 4 rows each, groups of 4 contiguous in the all-process order.
    rows = [{"task_id": t} for t in ["a", "a", "a", "a", "b", "b", "b", "b"]]
    p0 = rollout_ids(rows[:4], id_column="task_id", num_generations=4, process_index=0)
    p1 = rollout_ids(rows[4:], id_column="task_id", num_generations=4, process_index=1)
    assert p0 + p1 == [f"{t}:{k}" for t in "ab" for k in range(4)]
    # groups of 4 split across processes of 2 rows each
    q = [rollout_ids(rows[2 * i: 2 * i + 2], id_column="task_id", num_generations=4,
                     process_index=i) for i in range(4)]
    assert sum(q, []) == [f"{t}:{k}" for t in "ab" for k in range(4)]
    with pytest.raises(AlignmentError, match="share a rollout id"):
        rollout_ids([{"task_id": "a"}] * 4, id_column="task_id", num_generations=2,
                    process_index=0)
    with pytest.raises(AlignmentError, match="no dataset column 'task'"):
        rollout_ids(rows[:1], id_column="task", num_generations=2, process_index=0)


def test_advantage_files_read_each_file_once_and_hold_only_what_batches_need(table, monkeypatch):
    from draco_cli.trainers import loader

    spans = pl.read_parquet(table / "spans.parquet")
    files = []
    for k, rid in enumerate(["u1:0", "u1:1", "u2:0"]):
        f = table / f"step{k}.parquet"
        spans.filter(pl.col("rollout_id") == rid).write_parquet(f)
        files.append(str(f))
    reads = []
    real_read = loader.pq.read_table
    monkeypatch.setattr(loader.pq, "read_table", lambda f, *a, **k: reads.append(f) or
                        real_read(f, *a, **k))
    af = loader.AdvantageFiles()
    mask = np.ones((2, 6), dtype=np.int64)
    got = af.load(files, ["u2:0", "u1:0"])
    want = load_token_advantages(files, rollout_ids=["u2:0", "u1:0"])
    np.testing.assert_array_equal(got.batch(["u2:0", "u1:0"], mask, strict=False),
                                  want.batch(["u2:0", "u1:0"], mask, strict=False))
    assert len(got) == 2 and sorted(af._tables) == [files[0], files[2]]   # step1 not held
    reads.clear()
    assert "u1:1" in af.load(files, ["u1:1"]) and reads == [files[1]]   # only the file needed
    assert len(af.load(files, ["nobody"])) == 0 and af._tables == {}
    # a rollout id in two files is refused, as load_token_advantages refuses it
    spans.filter(pl.col("rollout_id") == "u1:1").write_parquet(table / "again.parquet")
    with pytest.raises(AlignmentError, match="duplicate rollout_id"):
        af.load([*files, str(table / "again.parquet")], ["u1:1"])
    # a file dropped from the glob: its twin alone holds the id again
    assert "u1:1" in af.load([files[0], str(table / "again.parquet")], ["u1:1"])
