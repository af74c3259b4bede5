"""docs/trainers.md's rLLM block runs: on the contract of rLLM's structures, and on rLLM's own
code where DRACO_RLLM_SRC names a snapshot (tests/trainers/rllm_structures.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.trainers.rllm_structures import RLLM_SRC, make_episodes, structures
from tests.trainers.test_docs import _block, _run


@pytest.mark.parametrize("kind", ["contract", pytest.param("real", marks=pytest.mark.skipif(
    not RLLM_SRC, reason="DRACO_RLLM_SRC (a snapshot of rllm-org/rllm) not set"))])
def test_rllm_block(kind, tmp_path, capsys):
    rl = structures(kind)
    ns = {"episodes": make_episodes(rl, np.random.default_rng(0), tasks=2, n=4),
          "transform_config": rl.config, "_default_traj_grouping_hook": rl.grouping,
          "tokenizer": SimpleNamespace(decode=lambda ids: " ".join(f"w{i}" for i in ids))}
    _run(_block("DracoGroupingHook", "scorer.close()"), ns, tmp_path)
    # the step scored (0) and its groups, as the block's comment says; the hook is at the next
    assert capsys.readouterr().out.split() == ["0", "2.0"] and ns["hook"].train_step == 1
    assert (tmp_path / "runs/rllm/llm_calls.sqlite").exists()
