"""The rollout side of slime's in-loop route: ``--custom-reward-post-process-path``.

See docs/trainers.md, "slime" ("In the loop"). slime calls ``score_rewards(args, samples)`` from
``_post_process_rewards`` (``slime/ray/rollout.py`` at 624b824a) with the step's samples
flattened. The values reach the training side only through ``draco_step_dir``: slime hands its
training actors a fixed list of per-sample keys, with no room for free-form data.
"""

from __future__ import annotations

import threading
from typing import Any

from draco_cli.errors import UsageError

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def _decode(args: Any) -> Any:
    spec = getattr(args, "draco_tokenizer", None)
    if spec:
        from draco_cli.ingest.slime import tokenizer_decode

        return tokenizer_decode(spec)
    checkpoint = getattr(args, "hf_checkpoint", None)
    if not checkpoint:
        raise UsageError("draco_tokenizer: PATH (a tokenizer.json) or slime's --hf-checkpoint "
                         "is needed to turn the samples' ids into text for the judge")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    return lambda ids: str(tok.decode(ids))


def _scorer(args: Any) -> Any:
    if "scorer" not in _STATE:
        from draco_cli.inloop import BlockingStepScorer

        settings = dict(getattr(args, "draco_judge", None) or {})
        if "model" not in settings:
            raise UsageError("draco_judge: give at least its model (a dict of "
                             "BlockingStepScorer arguments) in the --custom-config-path YAML")
        group = int(args.n_samples_per_prompt)
        _STATE["decode"] = _decode(args)
        _STATE["scorer"] = BlockingStepScorer(settings.pop("model"), group_size=group,
                                              decode=_STATE["decode"], **settings)
        _STATE["step"] = int(getattr(args, "start_rollout_id", 0) or 0)
    return _STATE["scorer"]


def score_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """Judge the step's samples, write the step's tables, return the raw rewards twice."""
    from draco_cli.inloop import write_step
    from draco_cli.trainers.slime.records import reward_of, sample_rollout

    step_dir = getattr(args, "draco_step_dir", None)
    if not step_dir:
        raise UsageError("draco_step_dir: the folder the step tables go to (and "
                         "draco_token_advantages reads) is not set")
    reward_key = getattr(args, "reward_key", None)
    raw = [reward_of(s, f"sample {i}", reward_key) for i, s in enumerate(samples)]
    if any(r is None for r in raw):
        raise UsageError(f"sample {raw.index(None)} has no reward: slime's reward model runs "
                         "before the reward post-process")
    with _LOCK:
        scorer = _scorer(args)
        _STATE["step"] += 1
        step = _STATE["step"]
        decode = _STATE["decode"]
        rollouts = [r for i, s in enumerate(samples)
                    if (r := sample_rollout(s, where=f"sample {i}", decode=decode,
                                            train_step=step, row=i, reward_key=reward_key,
                                            keep_removed=True)) is not None]
        result = scorer.score_step(rollouts, step)
        write_step(result, step_dir, keep=getattr(args, "draco_keep", None))
        _STATE["last"] = result
    values = [float(r) for r in raw if r is not None]
    return values, list(values)


def close() -> None:
    """End the run's scorer (its event loop thread and call log)."""
    with _LOCK:
        scorer = _STATE.pop("scorer", None)
        _STATE.clear()
    if scorer is not None:
        scorer.close()
