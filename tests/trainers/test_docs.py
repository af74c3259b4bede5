"""docs/trainers.md: every Python block runs, and its figures are the measured ones."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from draco_cli.trainers.loader import load_token_advantages

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "trainers.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


@pytest.fixture(scope="module")
def sample_runs(tmp_path_factory):
    """The bundled sample through `draco run` (recorded call log), DRACO and uniform credit."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(REPO / "sample_data", root / "sample_data")
    for setting, out in (("draco", "runs/demo"), ("no-credit", "runs/uniform")):
        subprocess.run([sys.executable, "-m", "draco_cli", "run",
                        "--rollouts", "sample_data/appworld_mini/rollouts.parquet",
                        "--steps", "sample_data/appworld_mini/steps.parquet",
                        "--model", "replay/sample_data/llm_calls.sqlite",
                        "--setting", setting, "-o", out], cwd=root, check=True,
                       capture_output=True)
    return root


def _run(block: str, namespace: dict, cwd: Path) -> None:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(block, str(DOC), "exec"), namespace)
    finally:
        os.chdir(old)


def _block(*words: str) -> str:
    """The one Python block of the page that holds every word."""
    found = [b for b in BLOCKS if all(w in b for w in words)]
    assert len(found) == 1, f"docs/trainers.md: {len(found)} blocks hold {words}"
    return found[0]


def test_every_python_block_is_counted():
    # the rLLM and slime sections' blocks run in tests/trainers/test_rllm_docs.py and
    # tests/trainers/test_slime.py
    assert len(BLOCKS) == 9


def _openrlhf_block(marker: str) -> str:
    """The OpenRLHF section's block containing ``marker`` (found by content, not position)."""
    section = DOC.read_text().split("## OpenRLHF")[1].split("\n## ")[0]
    found = [b for b in re.findall(r"```python\n(.*?)```", section, re.DOTALL) if marker in b]
    assert len(found) == 1, marker
    return found[0]


def test_loader_block(sample_runs):
    _run(BLOCKS[0], {}, sample_runs)


def test_verl_id_block(sample_runs):
    _run(BLOCKS[1], {}, sample_runs)


@pytest.mark.trainers
def test_trl_block(sample_runs, tmp_path):
    pytest.importorskip("trl", reason="needs the trainers extra (TRL 1.16.0)")
    from datasets import Dataset
    from trl import GRPOConfig

    from tests.trainers.chatml import chatml_tokenizer
    from tests.trainers.test_trl import _model

    tok = chatml_tokenizer()
    ns = {"tokenizer": tok, "model": _model(tok),
          "dataset": Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]],
                                        "task_id": ["t0"]}),
          "args": GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             num_generations=2, max_completion_length=4, use_cpu=True,
                             report_to=[], bf16=False)}
    _run(_block("token_advantages=", "rollout_ids"), ns, sample_runs)
    assert type(ns["trainer"]).__name__ == "DracoGRPOTrainer"


@pytest.mark.trainers
def test_trl_in_step_script(tmp_path, capsys):
    """The complete TRL script, in an empty folder: 2 steps, judged by mock/ in the step."""
    pytest.importorskip("trl", reason="needs the trainers extra (TRL 1.16.0)")
    ns: dict = {}
    _run(_block("judge=", "trainer.train()"), ns, tmp_path)
    logged = [h for h in ns["trainer"].state.log_history if "draco/groups" in h]
    assert [h["draco/groups"] for h in logged] == [2.0, 2.0]
    assert all(h["draco/judge_calls"] > 0 for h in logged)
    # a learning signal: some advantage is not zero, and the policy gets a gradient from it
    assert all(h["draco/signal_ok"] == 1.0 and h["grad_norm"] > 0 for h in logged), logged
    assert "'draco/judge_calls'" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "runs/trl-demo/draco").iterdir()) == [
        "step-000000", "step-000001"]
    assert (tmp_path / "runs/trl-demo/llm_calls.sqlite").exists()


@pytest.mark.trainers
def test_openrlhf_agent_block(tmp_path, capsys):
    pytest.importorskip("openrlhf", reason="needs the trainers extra (OpenRLHF 0.11.2)")
    import asyncio
    from types import SimpleNamespace

    from tests.trainers.chatml import chatml_tokenizer
    from tests.trainers.test_openrlhf import _Vllm

    ns: dict = {}
    _run(_openrlhf_block("class AgentExecutor(DracoAgentExecutor)"), ns, tmp_path)
    tok = chatml_tokenizer()
    engine = _Vllm(tok, 0)
    out = asyncio.run(ns["AgentExecutor"]().execute(
        "Book a flight.", "", SimpleNamespace(max_tokens=None, logprobs=None), 64, tok, engine))
    rid = out["extra_logs"]["draco_rollout_id"]      # on the final step's extra_logs
    n_prompt = len(tok(text="Book a flight.", add_special_tokens=False)["input_ids"])
    n_action = out["action_ranges"][0][1] - out["action_ranges"][0][0]
    assert capsys.readouterr().out.split() == [str(rid), str(n_prompt), str(n_action)]


@pytest.mark.trainers
def test_openrlhf_hook_block(tmp_path, monkeypatch):
    pytest.importorskip("openrlhf", reason="needs the trainers extra (OpenRLHF 0.11.2)")
    from tests.trainers.test_openrlhf import RemoteExperienceMaker, draco_orl, ppo_trainer

    ns: dict = {}
    _run(_openrlhf_block("def setup():"), ns, tmp_path)
    monkeypatch.setattr(ppo_trainer, "RemoteExperienceMaker", RemoteExperienceMaker)
    ns["setup"]()
    assert issubclass(ppo_trainer.RemoteExperienceMaker, draco_orl.DracoExperienceMaker)


@pytest.mark.trainers
def test_openrlhf_step_block(tmp_path):
    pytest.importorskip("openrlhf", reason="needs the trainers extra (OpenRLHF 0.11.2)")
    ns: dict = {}
    _run(_openrlhf_block("put_step(samples"), ns, tmp_path)
    m = ns["result"].metrics
    assert m["draco/judge_calls"] > 0 and len(ns["result"].rows) == 2
    # the page's printed figures: a signal, with opposite signs on the two samples
    assert (m["draco/signal_ok"], m["draco/nonzero_share"]) == (1.0, 1.0)
    first, second = (s.advantages.sum().item() for s in ns["samples"])
    assert first > 0 > second


def _policy_values(run: Path, rollouts: pl.DataFrame) -> np.ndarray:
    table = load_token_advantages(run / "credit" / "token_advantages.parquet")
    vals = []
    for rid, spans in zip(rollouts["rollout_id"], rollouts["policy_spans"]):
        adv = table.get(rid)
        vals += [adv[a:b] for a, b in spans]
    return np.concatenate(vals)


def test_gap_token_figures_are_measured(sample_runs):
    rollouts = pl.read_parquet(sample_runs / "sample_data/appworld_mini/rollouts.parquet")
    draco = _policy_values(sample_runs / "runs/demo", rollouts)
    uniform = _policy_values(sample_runs / "runs/uniform", rollouts)
    text = DOC.read_text()
    m_d, m_u = np.abs(draco).mean(), np.abs(uniform).mean()
    figures = {
        "policy tokens": f"{draco.size} policy tokens",
        "zero share": f"**{(draco == 0).mean():.1%}** of policy\ntokens get 0",
        "uniform zero share": f"{(uniform == 0).mean():.1%} under uniform credit",
        "mean": f"**{m_d:.3f}**, **{1 - m_d / m_u:.1%}** below",
        "uniform mean": f"**{m_u:.3f}**",
    }
    for name, phrase in figures.items():
        assert phrase in text, f"docs/trainers.md: {name}: expected {phrase!r}"
