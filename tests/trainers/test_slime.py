"""slime: the custom advantage function, ``draco ingest slime``, ``draco export --to slime``
and the in-loop reward post-process, against slime's structures (tests/trainers/
slime_contract.py: slime's own code where importable, else the contract of commit 624b824a)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest

torch = pytest.importorskip("torch")

from draco_cli.errors import InputError, UsageError  # noqa: E402
from draco_cli.ingest import ingest  # noqa: E402
from draco_cli.trainers import slime as draco_slime  # noqa: E402
from draco_cli.trainers.loader import AlignmentError, load_token_advantages  # noqa: E402
from draco_cli.trainers.slime.layout import cp_local, cp_response_ranges  # noqa: E402
from tests.trainers.slime_contract import (  # noqa: E402
    as_objects,
    make_samples,
    megatron_mpu,
    rank_data,
    real_slime,
    save_dump,
    zigzag,
)

PROMPTS, N = 3, 4


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A byte-level BPE tokenizer.json made here (no hub, no transformers)."""
    from tokenizers import ByteLevelBPETokenizer

    from tests.trainers.chatml import CORPUS, SPECIAL

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=320, min_frequency=2,
                            special_tokens=SPECIAL, show_progress=False)
    bpe.save(str(path))
    return path


def _draco(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "draco_cli", *argv], cwd=cwd,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer_json):
    """A slime dump (step 7) → draco ingest slime → credit: (samples, dump, run folder)."""
    root = tmp_path_factory.mktemp("slime")
    rng = np.random.default_rng(3)
    samples = make_samples(rng, PROMPTS, N, start_index=40)
    # a pair alike in length and loss mask, different in tokens: only ids tell them apart
    first, second = samples[0], samples[1]
    n = first["response_length"]
    prompt = second["tokens"][: len(second["tokens"]) - second["response_length"]]
    samples[1] = {**second, "tokens": prompt + rng.integers(3, 300, size=n).tolist(),
                  "response_length": n, "loss_mask": list(first["loss_mask"])}
    dump = save_dump(root / "rollout_data" / "7.pt", 7, samples)
    # the commands a user runs: ingest the dump, score it (mock judge, in-process, no network)
    out = _draco("ingest", "slime", str(dump), "--tokenizer", str(tokenizer_json),
                 "-o", "run/ingest", cwd=root)
    assert f"ingested {PROMPTS * N} rollouts in {PROMPTS} groups" in out.stderr
    _draco("run", "--rollouts", "run/ingest/rollouts.parquet", "--steps",
           "run/ingest/steps.parquet", "--model", "mock/any", "-o", "run", cwd=root)
    return samples, dump, root / "run"


def _args(source, **kw):
    return SimpleNamespace(draco_token_advantages=str(source), normalize_advantages=False, **kw)


def _call(args, data, cp_rank=0, cp_size=1):
    with megatron_mpu(cp_rank, cp_size):
        draco_slime.advantages(args, data)
    return data


def test_cp_cut_is_slimes_zigzag():
    n = 0
    for size in (1, 2, 3, 4):
        for total in range(2, 40):
            for resp in range(1, total):
                row = np.arange(1, resp + 1, dtype=np.float32)
                parts = []
                for rank in range(size):
                    got = cp_local(row, total, rank, size)
                    np.testing.assert_array_equal(got, zigzag(row, total, rank, size))
                    parts.append(got)
                    n += 1
                # every response token lives on exactly one rank
                np.testing.assert_array_equal(np.sort(np.concatenate(parts)), row)
    assert n > 5000
    assert cp_response_ranges(10, 4, 0, 1) == ((0, 4), (0, 0))
    with pytest.raises(ValueError):
        cp_response_ranges(3, 4, 0, 2)


def test_ingest_positions_from_slime_tokens(run):
    samples, _, folder = run
    rows = pl.read_parquet(folder / "ingest" / "rollouts.parquet")
    steps = pl.read_parquet(folder / "ingest" / "steps.parquet")
    by_id = {r["rollout_id"]: r for r in rows.iter_rows(named=True)}
    for s in samples:
        r = by_id[str(s["index"])]
        assert r["group_id"] == str(s["group_index"]) and r["train_step"] == 7
        assert r["response_len"] == s["response_length"] and r["outcome"] == s["reward"]
        mask = np.asarray(s["loss_mask"])
        spans = [tuple(p) for p in r["policy_spans"]]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], mask, [0]))))
        assert spans == list(zip(edges[0::2].tolist(), edges[1::2].tolist()))
        own = steps.filter(pl.col("rollout_id") == r["rollout_id"])
        assert own["token_start"].to_list() == [a for a, _ in spans]
    manifest = json.loads((folder / "ingest" / "manifest.json").read_text())
    assert manifest["format"] == "slime" and manifest["rollouts"] == len(samples)


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_every_value_on_its_token_after_dp_reordering(run, cp_size):
    samples, _, folder = run
    table = load_token_advantages(folder / "credit" / "token_advantages.parquet")
    order = np.random.default_rng(cp_size).permutation(len(samples)).tolist()
    got: dict[str, list[np.ndarray]] = {}
    for part in (order[::2], order[1::2]):          # two DP ranks, slime's reordering
        for rank in range(cp_size):
            data = _call(_args(folder), rank_data(samples, part, cp_rank=rank,
                                                  cp_size=cp_size), rank, cp_size)
            assert len(data["advantages"]) == len(part) == len(data["returns"])
            for j, adv in zip(part, data["advantages"]):
                s = samples[j]
                want = table.get(str(s["index"]))
                assert adv.dtype == torch.float32
                np.testing.assert_array_equal(
                    adv.numpy(), zigzag(want, len(s["tokens"]), rank, cp_size))
                got.setdefault(str(s["index"]), []).append(adv.numpy())
    nonzero = []
    for s in samples:
        want = table.get(str(s["index"]))
        assert not want[np.asarray(s["loss_mask"]) == 0].any()
        assert sum(len(p) for p in got[str(s["index"])]) == s["response_length"]
        if want.any():
            nonzero.append(want[want != 0][0])
    # values to misplace: several rollouts carry some, not all alike (mock/'s verdicts follow
    # the prompt's text, so how many moves with the prompt version)
    assert len(nonzero) >= 2 and len(set(nonzero)) >= 2


def test_mismatches_refused(run):
    samples, _, folder = run
    part = list(range(len(samples)))
    # a response one token shorter than the scored one
    cut = [dict(s) for s in samples]
    cut[2] = {**cut[2], "tokens": cut[2]["tokens"][:-1],
              "response_length": cut[2]["response_length"] - 1,
              "loss_mask": cut[2]["loss_mask"][:-1]}
    with pytest.raises(AlignmentError, match="not the same response"):
        _call(_args(folder), rank_data(cut, part))
    # two samples of equal length and mask (different tokens) whose ids were swapped
    data = rank_data(samples, part)
    assert data["response_lengths"][0] == data["response_lengths"][1]
    data["sample_indices"][0], data["sample_indices"][1] = (data["sample_indices"][1],
                                                            data["sample_indices"][0])
    with pytest.raises(AlignmentError, match="response_fingerprint"):
        _call(_args(folder), data)
    # a sample draco never scored
    stray = [dict(s) for s in samples]
    stray[0] = {**stray[0], "index": 999}
    with pytest.raises(AlignmentError, match="no advantages"):
        _call(_args(folder), rank_data(stray, part))
    # duplicate sample index
    dup = rank_data(samples, [0, 0])
    with pytest.raises(AlignmentError, match="twice"):
        _call(_args(folder), dup)
    # slime's KL on this rank is not the CP cut draco made
    data = rank_data(samples, part, cp_rank=0, cp_size=2)
    with pytest.raises(AlignmentError, match="zigzag"):
        _call(_args(folder), data, 0, 1)
    # whitening after the function would change draco's values
    with pytest.raises(UsageError, match="normalize"):
        _call(SimpleNamespace(draco_token_advantages=str(folder), normalize_advantages=True),
              rank_data(samples, part))
    with pytest.raises(UsageError, match="draco_token_advantages"):
        _call(SimpleNamespace(normalize_advantages=False), rank_data(samples, part))


def test_only_the_last_pipeline_stage_is_written(run):
    samples, _, folder = run
    data = rank_data(samples, [0, 1])
    with megatron_mpu(last_stage=False):
        draco_slime.advantages(_args(folder), data)
    assert "advantages" not in data and "returns" not in data


def test_export_without_records_is_the_run(run, tmp_path):
    samples, _, folder = run
    res = draco_slime.export(folder, tmp_path / "all.parquet")
    assert res.rollouts == len(samples) and "not checked" in res.notes[0]
    got = load_token_advantages(tmp_path / "all.parquet")
    want = load_token_advantages(folder / "credit" / "token_advantages.parquet")
    for s in samples:
        np.testing.assert_array_equal(got.get(str(s["index"])), want.get(str(s["index"])))
    with pytest.raises(Exception, match="exists"):
        draco_slime.export(folder, tmp_path / "all.parquet")


def test_removed_sample_gets_zeros_without_lookup(run):
    samples, _, folder = run
    gone = [dict(s) for s in samples]
    gone[5] = {**gone[5], "index": 12345, "remove_sample": True}
    data = _call(_args(folder), rank_data(gone, list(range(len(gone)))))
    assert not data["advantages"][5].any() and len(data["advantages"][5]) == \
        gone[5]["response_length"]


def test_ingest_refusals(tmp_path, tokenizer_json):
    rng = np.random.default_rng(0)
    samples = make_samples(rng, 1, 2)
    with pytest.raises(UsageError, match="tokenizer"):
        ingest("slime", [save_dump(tmp_path / "a.pt", 0, samples)], tmp_path / "o1",
               tokenizer=None)
    bad = [dict(s) for s in samples]
    bad[1] = {**bad[1], "loss_mask": bad[1]["loss_mask"][:-1]}
    with pytest.raises(InputError, match="loss_mask has"):
        ingest("slime", [save_dump(tmp_path / "b.pt", 0, bad)], tmp_path / "o2",
               tokenizer=str(tokenizer_json))
    keyed = [{**s, "reward": {"acc": 1.0, "fmt": 0.0}} for s in samples]
    with pytest.raises(InputError, match="reward-key"):
        ingest("slime", [save_dump(tmp_path / "c.pt", 0, keyed)], tmp_path / "o3",
               tokenizer=str(tokenizer_json))
    d = save_dump(tmp_path / "d.pt", 0, samples)
    with pytest.raises(InputError, match="again"):
        ingest("slime", [d, d], tmp_path / "o4", tokenizer=str(tokenizer_json))
    (tmp_path / "e.pt").write_bytes(b"not a dump")
    with pytest.raises(InputError, match="e.pt"):
        ingest("slime", [tmp_path / "e.pt"], tmp_path / "o5", tokenizer=str(tokenizer_json))
    assert not any((tmp_path / f"o{i}").exists() and any((tmp_path / f"o{i}").iterdir())
                   for i in range(1, 6))


def test_export_cli_checked_and_read_back(run, tmp_path):
    samples, dump, folder = run
    out = tmp_path / "step-7.slime.parquet"
    proc = subprocess.run([sys.executable, "-m", "draco_cli", "export", "--to", "slime",
                           "--advantages", str(folder), "--records", str(dump), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {len(samples)} rollouts" in proc.stderr
    table = pl.read_parquet(out)
    assert table["sample_index"].to_list() == [s["index"] for s in samples]
    want = load_token_advantages(folder / "credit" / "token_advantages.parquet")
    data = _call(_args(out), rank_data(samples, list(range(len(samples)))[::-1]))
    for s, adv in zip(samples[::-1], data["advantages"]):
        np.testing.assert_array_equal(adv.numpy(), want.get(str(s["index"])))
    # records that are not the scored samples are refused, nothing written
    other = [dict(s) for s in samples]
    other[0] = {**other[0], "tokens": other[0]["tokens"][:-1] + [other[0]["tokens"][-1] + 1]}
    wrong = save_dump(tmp_path / "wrong.pt", 7, other)
    proc = subprocess.run([sys.executable, "-m", "draco_cli", "export", "--to", "slime",
                           "--advantages", str(folder), "--records", str(wrong),
                           "-o", str(tmp_path / "x.parquet")], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "fingerprint" in proc.stderr or "response" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.skipif(not real_slime(), reason="slime's own source is not on PYTHONPATH")
def test_real_slime_compute_advantages_and_returns(run):
    """slime's own compute_advantages_and_returns loads and calls draco's function."""
    samples, _, folder = run
    table = load_token_advantages(folder / "credit" / "token_advantages.parquet")
    for cp_size in (1, 2):
        for rank in range(cp_size):
            with megatron_mpu(rank, cp_size):
                sys.modules.pop("slime.backends.megatron_utils.loss", None)
                sys.modules.pop("slime.backends.megatron_utils.cp_utils", None)
                from slime.backends.megatron_utils import loss
                from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

                data = rank_data(samples, list(range(len(samples))))
                data["log_probs"] = [slice_log_prob_with_cp(torch.zeros(r), t, r) for r, t in
                                     zip(data["response_lengths"], data["total_lengths"])]
                args = SimpleNamespace(
                    use_rollout_logprobs=False, kl_coef=0.0, advantage_estimator="grpo",
                    custom_advantage_function_path="draco_cli.trainers.slime.advantages",
                    use_opd=False, normalize_advantages=False,
                    draco_token_advantages=str(folder))
                loss.compute_advantages_and_returns(args, data)
            for s, adv, ret in zip(samples, data["advantages"], data["returns"]):
                full = table.get(str(s["index"]))
                np.testing.assert_array_equal(adv.numpy(),
                                              zigzag(full, len(s["tokens"]), rank, cp_size))
                assert torch.equal(adv, ret)


def test_in_the_loop_reward_post_process_then_advantages(run, tokenizer_json, tmp_path,
                                                        monkeypatch):
    """Rollout side: slime's reward post-process judges the step and writes it; training
    side: the advantage function reads that folder; every row gets the scorer's values."""
    from draco_cli.trainers.slime import inloop
    from tests.llm_server import FakeLLMServer
    from tests.test_rubric_judge import scripted

    samples, _, _ = run
    samples = [dict(s) for s in samples]
    samples[3] = {**samples[3], "remove_sample": True}   # judged with its group, trains on 0
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    server = FakeLLMServer(answer=scripted).start()
    steps = tmp_path / "steps"
    args = SimpleNamespace(
        n_samples_per_prompt=N, reward_key=None, start_rollout_id=6,
        draco_tokenizer=str(tokenizer_json), draco_step_dir=str(steps), draco_keep=2,
        draco_judge={"model": "openai/m", "base_url": server.url + "/v1",
                     "call_log": tmp_path / "calls.sqlite"},
        draco_token_advantages=str(steps), normalize_advantages=False)
    try:
        raw, rewards = draco_slime.score_rewards(args, as_objects(samples))
        result = inloop._STATE["last"]
    finally:
        inloop.close()
        server.stop()
    assert raw == rewards == [s["reward"] for s in samples]   # slime's own, unchanged
    assert result.train_step == 7 and not result.fallbacks
    assert (steps / "step-000007" / "credit" / "token_advantages.parquet").is_file()
    assert set(result.rows) == {str(s["index"]) for s in samples}
    assert sum(bool(r.values.any()) for r in result.rows.values()) > N
    order = np.random.default_rng(1).permutation(len(samples)).tolist()
    for rank in range(2):
        data = _call(args, rank_data(samples, order, cp_rank=rank, cp_size=2), rank, 2)
        for j, adv in zip(order, data["advantages"]):
            s = samples[j]
            want = result.rows[str(s["index"])].values
            if s["remove_sample"]:
                want = np.zeros_like(want)
            np.testing.assert_array_equal(adv.numpy(),
                                          zigzag(want, len(s["tokens"]), rank, 2))


def test_docs_section_blocks_run():
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainers.md").read_text()
    section = doc.split("\n## slime\n")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1
    for block in blocks:
        exec(compile(block, "docs/trainers.md#slime", "exec"), {})
