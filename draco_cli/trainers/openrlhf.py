"""OpenRLHF (0.11): draco's token advantages in place of the experience maker's estimator.

See docs/trainers.md, "OpenRLHF (0.11)". OpenRLHF has no switch to skip its estimator, hence
``DracoExperienceMaker`` over ``RemoteExperienceMaker``. Its ``action_mask`` starts one token
into the sequence, so response token t of row b sits at column ``P_b - 1 + t`` (``place``).
The agent side is ``draco_cli.trainers.openrlhf_agent``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.errors import InputError, UsageError
from draco_cli.trainers import lazy_class, openrlhf_agent
from draco_cli.trainers.loader import (
    AlignmentError,
    TokenAdvantageTable,
    fingerprint,
    load_token_advantages,
)
from draco_cli.trainers.openrlhf_agent import ID_KEY, AgentTokens, agent_tokens

__all__ = ["ID_KEY", "STEP_KEY", "AgentTokens", "DracoAgentExecutor",  # noqa: F822
           "DracoExperienceMaker", "DracoSamplesGenerator", "agent_tokens",
           "experience_rollout_ids",
           "StepJudge", "advantages_from_files", "experience_rollouts", "install",
           "place", "put_step", "step_table", "truncated_rows"]

STEP_KEY = "draco_train_step"
TRUNCATED = "draco/truncated_rollouts"


def experience_rollout_ids(experience: Any, *, id_key: str = ID_KEY,
                           ids_from_index: Callable[[int], str] | None = None) -> list[str]:
    """The rollout id of each row of one Experience: the number the agent sent through
    ``extra_logs`` (``info[id_key]``) as a decimal string, else ``ids_from_index(index)``."""
    info = experience.info or {}
    if id_key in info:
        vals = info[id_key]
        vals = vals.tolist() if hasattr(vals, "tolist") else list(vals)
        return [str(int(v)) for v in vals]
    if ids_from_index is None or experience.index is None:
        raise AlignmentError(f"experience rows carry no {id_key!r} in info (send it through the "
                             "agent's extra_logs) and no ids_from_index was given")
    return [ids_from_index(int(i)) for i in experience.index]


def place(table: TokenAdvantageTable, ids: Sequence[str], action_mask: np.ndarray,
          sequences: np.ndarray | None = None, *, train_step: Any = None) -> np.ndarray:
    """float32 [B, A] advantages laid on OpenRLHF's action columns, checked row by row.

    Row b's response starts at action column c_b (its first 1), so response token t goes to
    column c_b + t and its token id is ``sequences[b, c_b + 1 + t]``."""
    mask = np.asarray(action_mask).astype(np.int64)
    B, A = mask.shape
    first = np.where(mask.any(axis=1), mask.argmax(axis=1), 0)
    shifted = np.zeros_like(mask)
    resp_ids = None if sequences is None else np.zeros((B, A), dtype=np.int64)
    for b in range(B):
        c = int(first[b])
        shifted[b, : A - c] = mask[b, c:]
        if resp_ids is not None and sequences is not None:
            resp_ids[b, : A - c] = sequences[b, c + 1: c + 1 + A - c]
    adv = table.batch(ids, shifted, response_ids=resp_ids, train_step=train_step)
    out = np.zeros((B, A), dtype=np.float32)
    for b in range(B):
        c = int(first[b])
        out[b, c:] = adv[b, : A - c]
    return out


def experience_rollouts(experiences: Sequence[Any], *, n_samples_per_prompt: int,
                        decode: Callable[[list[int]], str], train_step: int,
                        id_key: str = ID_KEY, start: int = 0) -> list[Any]:
    """One ``TrainerRollout`` per row of OpenRLHF's samples or experiences, in sample order
    (what a row is: docs/trainers.md, "OpenRLHF (0.11)"). A row's place i is
    ``experience.index`` (set by ``split_rollout_samples``), else its position in
    ``experiences``; its id the agent's ``extra_logs`` id (``info[id_key]``), else
    ``f"{train_step}:{i}"``."""
    from draco_cli.inloop import TrainerRollout

    n = n_samples_per_prompt
    if n < 1:
        raise UsageError(f"n_samples_per_prompt {n!r}: must be >= 1")
    by_place: dict[int, Any] = {}
    prompts: dict[int, str] = {}
    pos = start   # rows without an index: their place in the step's samples from ``start``
    for e in experiences:
        seqs, amask = e.sequences.cpu().numpy(), e.action_mask.cpu().numpy().astype(np.int8)
        lengths = e.attention_mask.cpu().numpy().sum(axis=1).astype(int)
        info = e.info or {}
        ids = experience_rollout_ids(e, id_key=id_key) if id_key in info else None
        for b in range(len(seqs)):
            i = int(e.index[b]) if e.index is not None else pos
            pos += 1
            L, row_mask = lengths[b], amask[b]
            c = int(row_mask.argmax()) if row_mask.any() else max(L - 1, 0)
            group = f"{train_step}/{i // n}"
            rid = ids[b] if ids is not None else f"{train_step}:{i}"
            r = TrainerRollout(
                rollout_id=rid, group_id=group,
                instruction=decode(seqs[b, : c + 1].tolist()),
                response_ids=seqs[b, c + 1: L].astype(np.int64),
                response_mask=row_mask[c: L - 1],
                outcome=None if e.rewards is None else float(e.rewards[b]),
                train_step=train_step, row=i)
            prompt = e.prompts[b] if e.prompts else None
            if i // n in prompts and prompt is not None and prompts[i // n] != prompt:
                raise InputError(
                    f"{r.where()}: its prompt differs from its group's first rollout's: the "
                    f"samples are not in runs of n_samples_per_prompt={n} rollouts of one "
                    "prompt", field="n_samples_per_prompt")
            if prompt is not None:
                prompts.setdefault(i // n, prompt)
            if i in by_place:
                raise InputError(f"{r.where()}: sample index {i} given twice", field="index")
            by_place[i] = r
    if len(by_place) % n:
        raise InputError(f"{len(by_place)} samples do not make groups of "
                         f"n_samples_per_prompt={n}", field="n_samples_per_prompt")
    return [by_place[i] for i in sorted(by_place)]


def truncated_rows(experience: Any) -> np.ndarray:
    """Rows OpenRLHF cut at ``max_len`` (``info["response_clip_ratio"]``) or whose generation
    hit its token budget (``truncated``), as a bool array."""
    B = len(experience.sequences)
    cut = np.zeros(B, dtype=bool)
    clip = (experience.info or {}).get("response_clip_ratio")
    for flags in (clip, experience.truncated):
        if flags is not None:
            cut |= np.asarray([bool(f) for f in flags], dtype=bool)
    return cut


def step_table(result: Any, rollouts: Sequence[Any]) -> TokenAdvantageTable:
    """The scored step as a loader table (in memory): each rollout's values with its
    train step, count of policy tokens and fingerprint, so ``place`` checks every row."""
    import pyarrow as pa

    vals = [np.asarray(result.rows[r.rollout_id].values, dtype=np.float32) for r in rollouts]
    table = pa.table({
        "rollout_id": pa.array([r.rollout_id for r in rollouts], pa.string()),
        "length": pa.array([len(v) for v in vals], pa.int32()),
        "advantages": pa.array(vals, pa.list_(pa.float32())),
        "train_step": pa.array([r.train_step for r in rollouts], pa.int64()),
        "n_policy_tokens": pa.array([int(np.count_nonzero(r.response_mask)) for r in rollouts],
                                    pa.int64()),
        "response_fingerprint": pa.array([fingerprint(r.response_ids) for r in rollouts],
                                         pa.string())})
    return TokenAdvantageTable(table, f"train step {result.train_step}")


def _fill(e: Any, table: TokenAdvantageTable, ids: Sequence[str], train_step: Any) -> None:
    """An experience's advantages (its ``returns`` too, their sum its ``info["return"]``),
    placed from ``table``; no KL."""
    import torch

    adv = place(table, ids, e.action_mask.cpu().numpy(), e.sequences.cpu().numpy(),
                train_step=train_step)
    e.advantages = torch.as_tensor(adv, device=e.action_mask.device)
    e.returns = e.advantages.clone()
    e.info["return"] = e.advantages.sum(dim=-1)
    e.kl = None


def put_step(experiences: Sequence[Any], result: Any, rollouts: Sequence[Any]) -> None:
    """Each row's advantages (``advantages`` = ``returns``, on its action columns) and the
    step's metrics (``info["draco/…"]``, one value per row) into the experiences, matched by
    ``experience.index`` (the row's place in the step's samples, see ``experience_rollouts``)."""
    import torch

    table = step_table(result, rollouts)
    by_place = {int(r.row): r.rollout_id for r in rollouts}
    metrics = dict(result.metrics)
    metrics[TRUNCATED] = float(sum(int(truncated_rows(e).sum()) for e in experiences))
    start = 0
    for e in experiences:
        B = len(e.sequences)
        places = [int(i) for i in e.index] if e.index is not None else \
            list(range(start, start + B))
        start += B
        _fill(e, table, [by_place[i] for i in places], result.train_step)
        for k, v in metrics.items():
            e.info[k] = torch.full((B,), float(v), dtype=torch.float32)


class StepJudge:
    """A maker's scoring in the step: its one ``BlockingStepScorer`` (made on first use from
    ``judge``, a dict of its arguments, or given ready), the thread that waits on it while
    OpenRLHF's model forwards run, the step counter, and the audit folders."""

    def __init__(self, judge: Any, *, group_size: int, decode: Callable[[list[int]], str],
                 id_key: str = ID_KEY, audit_dir: str | Path | None = None,
                 keep: int | None = None, start_step: int = 0) -> None:
        self.judge, self.group_size, self.decode, self.id_key = judge, group_size, decode, id_key
        self.audit_dir, self.keep, self.step = audit_dir, keep, start_step
        self.scorer: Any = None
        self.pool: ThreadPoolExecutor | None = None
        self.pending: tuple[list[Any], Future[Any]] | None = None
        self.last: Any = None
        # the next step's rollouts judged as the generator built them, and the samples of the
        # group being built (None: the generator is not handing samples over)
        self.early: dict[str, Any] | None = None
        self.building: list[Any] | None = None

    def open(self) -> Any:
        if self.scorer is None:
            from draco_cli.inloop import BlockingStepScorer

            if isinstance(self.judge, dict):
                settings = dict(self.judge)
                self.scorer = BlockingStepScorer(settings.pop("model"), group_size=self.group_size,
                                                 decode=self.decode, **settings)
            else:
                if self.judge.inner.group_size != self.group_size:
                    raise UsageError(f"judge: group_size {self.judge.inner.group_size} but "
                                     f"n_samples_per_prompt is {self.group_size}")
                self.scorer = self.judge
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="draco-step")
        return self.scorer

    def generation_started(self) -> None:
        """The next step's samples are being built (``DracoSamplesGenerator``)."""
        self.open()
        self.early, self.building = {}, []

    def sample_built(self, experience: Any) -> None:
        """A built sample: each ``group_size`` of them a prompt's group, judged now."""
        if self.building is None:
            return
        self.building.append(experience)
        if len(self.building) < self.group_size:
            return
        group, self.building = self.building, []
        assert self.early is not None
        rollouts = experience_rollouts(group, n_samples_per_prompt=self.group_size,
                                       decode=self.decode, train_step=self.step + 1,
                                       id_key=self.id_key, start=len(self.early))
        for r in rollouts:
            self.scorer.add(r)
            self.early[r.rollout_id] = r

    def generation_ended(self, failed: bool = False) -> None:
        if failed and self.early:   # generated again from scratch: nothing of it is kept
            self.scorer.discard(self.step + 1)
        self.building, self.early = None, None if failed else self.early

    def submit(self, rollout_samples: Sequence[Any]) -> None:
        """The step's samples (before OpenRLHF regroups them) go to the judge; those whose
        groups the generator already handed over (``sample_built``) are being judged."""
        self.open()
        self.step += 1
        rollouts = experience_rollouts(rollout_samples, n_samples_per_prompt=self.group_size,
                                       decode=self.decode, train_step=self.step,
                                       id_key=self.id_key)
        early = self.early or {}
        self.early = self.building = None
        for r in rollouts:
            got = early.get(r.rollout_id)
            if got is not None and (got.group_id, got.row, fingerprint(got.response_ids)) != (
                    r.group_id, r.row, fingerprint(r.response_ids)):
                raise InputError(f"{r.where()}: the step's samples are not the ones generated, "
                                 "in the order generated (judged as it was built as "
                                 f"{got.where()})", field="rollout_id")
        missing = set(early) - {r.rollout_id for r in rollouts}
        if missing:
            raise InputError(f"{len(missing)} generated samples are not in the step's batch "
                             f"(e.g. rollout {min(missing)!r}): draco judges a batch as it is "
                             "generated only when the batch is what was generated",
                             field="rollout_id")
        assert self.pool is not None  # made with the scorer
        rest = [r for r in rollouts if r.rollout_id not in early]   # the others are judging
        self.pending = (rollouts, self.pool.submit(self.scorer.score_step, rest, self.step))

    def deliver(self, experiences: Sequence[Any]) -> Any:
        """Wait for the step's result and put it into the (regrouped) experiences."""
        assert self.pending is not None
        rollouts, future = self.pending
        result = future.result()
        put_step(experiences, result, rollouts)
        if self.audit_dir is not None:
            from draco_cli.inloop import write_step

            write_step(result, self.audit_dir, keep=self.keep)
        self.last = result
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        if self.scorer is not None and isinstance(self.judge, dict):
            self.scorer.close()
        self.scorer = self.pool = None


def advantages_from_files(experiences: Sequence[Any], token_advantages: Any, *,
                          id_key: str = ID_KEY,
                          ids_from_index: Callable[[int], str] | None = None) -> None:
    """The file route: each experience's advantages from token_advantages.parquet file(s)."""
    rows = [experience_rollout_ids(e, id_key=id_key, ids_from_index=ids_from_index)
            for e in experiences]
    all_ids = list(itertools.chain.from_iterable(rows))
    files = token_advantages(all_ids) if callable(token_advantages) else token_advantages
    table = load_token_advantages(files, rollout_ids=all_ids)
    for e, ids in zip(experiences, rows):
        step = e.info.get(STEP_KEY) if e.info else None
        _fill(e, table, ids, None if step is None else [int(s) for s in step.tolist()])


# In-step judges of this process (a maker adds its own; OpenRLHF builds generator, then maker).
_JUDGES: list[StepJudge] = []


def _lone_judge() -> StepJudge | None:
    """The one judge; with several makers open none (each then judges its step itself)."""
    return _JUDGES[0] if len(_JUDGES) == 1 else None


def _generator_class() -> type[Any]:
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    class DracoSamplesGenerator(SamplesGenerator):  # type: ignore[misc]
        """OpenRLHF's ``SamplesGenerator`` handing each prompt's samples to the process's
        in-step judge as it builds them, judged while other prompts generate; only where the
        batch generated is the step's batch in the order built (no dynamic filtering,
        ``vllm_generate_batch_size`` = the batch size, nothing left over)."""

        def generate_samples(self, **generate_kwargs: Any) -> Any:
            judge = _lone_judge()
            args = self.args
            n = int(generate_kwargs.get("n_samples_per_prompt",
                                        args.rollout.n_samples_per_prompt))
            whole = judge if (judge is not None and n == judge.group_size
                              and not args.algo.dynamic_filtering_enable
                              and (getattr(args.rollout, "vllm_generate_batch_size", None)
                                   or args.rollout.batch_size) == args.rollout.batch_size
                              and not getattr(self, "_sample_buffer", None)) else None
            if whole is not None:
                whole.generation_started()
            failed = True
            try:
                out = super().generate_samples(**generate_kwargs)
                failed = False
                return out
            finally:
                if whole is not None:
                    whole.generation_ended(failed)

        def _process_response_into_experience(self, response: Any,
                                              **generate_kwargs: Any) -> Any:
            experience = super()._process_response_into_experience(response, **generate_kwargs)
            judge = _lone_judge()
            if judge is not None:
                judge.sample_built(experience)
            return experience

    return DracoSamplesGenerator


def _maker_class() -> type[Any]:
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    # OpenRLHF ships no types: its classes are Any to mypy
    class DracoExperienceMaker(RemoteExperienceMaker):  # type: ignore[misc]
        """``RemoteExperienceMaker`` whose advantages (and returns) are draco's; its keywords
        (``judge``, ``audit_dir``, ``keep``, ``start_step``; or ``token_advantages``) are in
        docs/trainers.md, "OpenRLHF (0.11)". ``judge`` may also be a ready
        ``BlockingStepScorer`` (group size and ``decode``, by default the tokenizer's, are the
        trainer's); ``id_key``/``ids_from_index`` as in ``experience_rollout_ids``."""

        def __init__(self, *args: Any, token_advantages: Any = None, judge: Any = None,
                     id_key: str = ID_KEY, ids_from_index: Callable[[int], str] | None = None,
                     audit_dir: str | Path | None = None, keep: int | None = None,
                     start_step: int = 0, decode: Callable[[list[int]], str] | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if (token_advantages is None) == (judge is None):
                raise UsageError("DracoExperienceMaker: give judge= (score in the step) or "
                                 "token_advantages= (files), one of the two")
            self.draco_token_advantages = token_advantages
            self.draco_id_key = id_key
            self.draco_ids_from_index = ids_from_index
            tokenizer = self.tokenizer
            self.draco_judge = None if judge is None else StepJudge(
                judge, group_size=int(self.args.rollout.n_samples_per_prompt),
                decode=decode or (lambda ids: str(tokenizer.decode(ids))), id_key=id_key,
                audit_dir=audit_dir, keep=keep, start_step=start_step)
            if self.draco_judge is not None:
                _JUDGES.append(self.draco_judge)

        def draco_close(self) -> None:
            """Close the judge's scorer (made from ``judge=`` settings) and its thread."""
            if self.draco_judge is not None:
                self.draco_judge.close()
                if self.draco_judge in _JUDGES:
                    _JUDGES.remove(self.draco_judge)

        def make_experience_batch(self, rollout_samples: list[Any]) -> list[Any]:
            judge = getattr(self, "draco_judge", None)
            if judge is None:
                return list(super().make_experience_batch(rollout_samples))
            judge.submit(rollout_samples)
            try:
                return list(super().make_experience_batch(rollout_samples))
            finally:
                judge.pending = None

        def compute_advantages_and_returns(self, experiences: list[Any]) -> list[Any]:
            judge = getattr(self, "draco_judge", None)
            if judge is not None and judge.pending is not None:
                judge.deliver(experiences)
            elif self.draco_token_advantages is not None:
                advantages_from_files(experiences, self.draco_token_advantages,
                                      id_key=self.draco_id_key,
                                      ids_from_index=self.draco_ids_from_index)
            else:
                raise UsageError("DracoExperienceMaker(judge=...): compute_advantages_and_"
                                 "returns runs inside make_experience_batch only")
            return experiences

    return DracoExperienceMaker


def install(**settings: Any) -> type[Any]:
    """Make OpenRLHF's trainer build a ``DracoExperienceMaker`` with these keyword arguments
    (``judge=...`` or ``token_advantages=...``, see the class) in this process: call it where
    the ``PPOTrainer`` actor runs (a Ray ``worker_process_setup_hook``). Returns the class."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer

    base = __getattr__("DracoExperienceMaker")
    if not settings.get("judge") and not settings.get("token_advantages"):
        raise UsageError("install: give judge=... or token_advantages=...")

    class Configured(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**settings, **kwargs})

    ppo_trainer.RemoteExperienceMaker = Configured
    if settings.get("judge"):   # each group judged as the generator builds it
        ppo_trainer.SamplesGenerator = __getattr__("DracoSamplesGenerator")
    return Configured


def __getattr__(name: str) -> type[Any]:
    # Built on first use: importing this module never imports OpenRLHF, Ray or torch.
    return lazy_class(globals(), name, {
        "DracoExperienceMaker": _maker_class, "DracoSamplesGenerator": _generator_class,
        "DracoAgentExecutor": lambda: openrlhf_agent.DracoAgentExecutor})
