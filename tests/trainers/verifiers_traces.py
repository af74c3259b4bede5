"""verifiers 0.4.0 traces built by verifiers' own graph code: each turn goes through
``graph.prepare_turn(trace, prompt).commit(Response(tokens=TurnTokens(...)))`` exactly as its
interception server commits a model call, with the renderer's per-message token spans, so the
nodes' ``token_ids``/``mask``/``logprobs`` are the ones verifiers itself lays out."""

from __future__ import annotations

import numpy as np
import verifiers.v1 as vf
from verifiers.v1 import graph
from verifiers.v1.task import WireTaskData
from verifiers.v1.types import AssistantMessage, Response, TurnTokens, UserMessage

HEADER = [1, 2]      # a chat template's role header before each message
GEN_PROMPT = [3]     # the generation prompt before each completion


def make_trace(rng: np.random.Generator, task: int, turns: int, *, ok: bool = True,
               reward: float | None = None, lengths: tuple[int, ...] | None = None,
               vocab: int = 900, spans: bool = True, tokens: bool = True) -> vf.Trace:
    """A ``turns``-turn tool-style conversation: user prompt, then per turn a sampled
    completion and (but for the last) a user/tool observation. ``spans=False``: a renderer
    without per-message spans (the prompt's tokens land on the assistant node as scaffold);
    ``tokens=False``: a relay turn with no token ids (an eval client)."""
    trace = vf.Trace(task=vf.TraceTask(type="Demo", data=WireTaskData(idx=task), key=f"t{task}"),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    prompt: list = [UserMessage(content=f"solve task {task}")]
    ids: list[int] = HEADER + rng.integers(10, vocab, 4).tolist()
    said_spans: list[tuple[int, int] | None] = [(0, len(ids))]
    for t in range(turns):
        n = lengths[t] if lengths else int(rng.integers(2, 9))
        completion = rng.integers(10, vocab, n).tolist()
        said = f"action {t} of task {task}: call {completion[0]}"
        turn = graph.prepare_turn(trace, prompt)
        turn.commit(Response(
            id=f"r{t}", created=0, model="policy", finish_reason="stop",
            message=AssistantMessage(content=said),
            tokens=TurnTokens(prompt_ids=ids + GEN_PROMPT, completion_ids=completion,
                              completion_logprobs=(-rng.random(n)).tolist(),
                              message_spans=said_spans if spans else None) if tokens else None))
        prompt = prompt + [AssistantMessage(content=said)]
        said_spans = said_spans + [(len(ids), len(ids) + len(GEN_PROMPT) + n)]
        ids = ids + GEN_PROMPT + completion
        if t < turns - 1:
            obs = HEADER + rng.integers(10, vocab, int(rng.integers(1, 6))).tolist()
            prompt = prompt + [UserMessage(content=f"observation {t}")]
            said_spans = said_spans + [(len(ids), len(ids) + len(obs))]
            ids = ids + obs
    trace.ok = ok
    trace.is_completed = True
    if reward is not None:
        trace.rewards = {"solved": vf.Reward(score=reward)}
    return trace


def make_group(rng: np.random.Generator, task: int, size: int, *, step: int = 3,
               turns: tuple[int, int] = (1, 4), errored: int = 0, **shape: bool
               ) -> list[vf.Episode]:
    """``size`` single-trace episodes of one prime-rl dispatch group (``group.id`` and the train
    step stamped as prime-rl's dispatcher stamps them); ``errored`` of them failed."""
    out = []
    for k in range(size):
        trace = make_trace(rng, task, int(rng.integers(*turns)), ok=k >= errored,
                           reward=float(rng.integers(0, 2)), **shape)
        out.append(vf.Episode(task=trace.task, traces=[trace], ok=trace.ok,
                              group=vf.GroupInfo(id=f"g{task}"),
                              run=vf.TrainRunInfo(id="run", work=vf.TrainWorkInfo(step=step))))
    return out
