"""Token positions: verl's own multi-turn token builder (Qwen ChatML) against draco's ingest.

verl's ``QwenContinuousTokenBuilder`` builds the response token ids and mask exactly as its
tool agent loop does (initial prompt, generated assistant tokens, tool context, next
generation). The ChatML tokenizer is built locally (tests/trainers/chatml.py).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import polars as pl
import pytest

from draco_cli.ingest import ingest
from draco_cli.inloop.rows import policy_runs
from draco_cli.trainers.loader import fingerprint
from tests.trainers.chatml import chatml_tokenizer


def mask_runs(mask):
    start, end = policy_runs(mask)
    return list(zip(start.tolist(), end.tolist()))


pytestmark = pytest.mark.trainers
pytest.importorskip("verl", reason="needs the trainers extra (verl 0.9.1)")
pytest.importorskip("transformers", reason="needs the trainers extra (transformers)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder


def _conversation(tok, obs_role="tool"):
    """Run verl's token builder over: user, assistant (tool call), tool, assistant."""
    ct = QwenContinuousTokenBuilder(tok)
    messages = [{"role": "user", "content": "Find the flights and book the cheapest one."}]
    runtime = ct.build_initial_tokens(messages)
    prompt_len = len(runtime)
    mask: list[int] = []
    replies = ["search(origin='SFO', destination='JFK')", "Booked UA 12, the cheapest."]
    tool_results = ["3 results: UA 12, DL 7, AA 100."]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for t, reply in enumerate(replies):
        # The policy generates its reply and stops at <|im_end|>, which it generated too.
        generated = tok.encode(reply, add_special_tokens=False) + [im_end]
        merged = ct.merge_assistant_tokens(runtime, generated)
        mask, _ = ct.align_response_metadata(merged, mask)
        runtime = merged.token_ids
        previous = list(messages)
        messages = messages + [{"role": "assistant", "content": reply}]
        if t < len(tool_results):
            messages_before_tool = list(messages)
            messages = messages + [{"role": obs_role, "content": tool_results[t]}]
            merged = ct.merge_context_tokens(messages_before_tool, messages, runtime)
            mask, _ = ct.align_response_metadata(merged, mask)
            runtime = merged.token_ids
        del previous
    return messages, runtime[prompt_len:], mask, replies, tool_results


def test_verl_mask_is_one_on_generated_tokens_only():
    tok = chatml_tokenizer()
    _, response, mask, replies, _ = _conversation(tok)
    assert len(response) == len(mask)
    runs = mask_runs(mask)
    assert len(runs) == 2
    for (a, b), reply in zip(runs, replies):
        assert tok.decode(response[a:b]) == reply + "<|im_end|>"
    gap = tok.decode(response[runs[0][1]:runs[1][0]])
    # The newline after <|im_end|>, the tool turn and the next assistant header: all mask 0.
    assert gap.startswith("\n<|im_start|>tool\n") and gap.endswith("<|im_start|>assistant\n")


def _for_draco(messages):
    """The same conversation as an OpenAI log: the tool result answers a call id."""
    out = [dict(m) for m in messages]
    out[1]["tool_calls"] = [{"id": "c1", "function": {"name": "search", "arguments": "{}"}}]
    out[2]["tool_call_id"] = "c1"
    return out


def _ingest(tmp_path, entry, name):
    log = tmp_path / f"{name}.jsonl"
    log.write_text(json.dumps(entry) + "\n")
    ingest("openai-jsonl", [log], tmp_path / name)
    r = pl.read_parquet(tmp_path / name / "rollouts.parquet").row(0, named=True)
    s = pl.read_parquet(tmp_path / name / "steps.parquet")
    return r, s


def test_ingest_positions_match_verl_under_the_documented_convention(tmp_path):
    """n_tokens convention (docs/ingest.md): an assistant message counts its generated tokens
    (through <|im_end|>); the newline, the next turns and the next assistant header belong to
    the observation block that follows. Logged that way, draco's positions are verl's mask."""
    tok = chatml_tokenizer()
    messages, response, mask, _, _ = _conversation(tok)
    messages = _for_draco(messages)
    runs = mask_runs(mask)
    gen = [b - a for a, b in runs]
    block = runs[1][0] - runs[0][1]
    logged = [messages[0],
              {**messages[1], "n_tokens": gen[0]},
              {**messages[2], "n_tokens": block},
              {**messages[3], "n_tokens": gen[1]}]
    base = {"rollout_id": "r", "task_id": "t"}
    r, s = _ingest(tmp_path, {**base, "messages": logged}, "counts")
    assert r["policy_spans"] == [list(x) for x in runs]
    assert s["token_start"].to_list() == [a for a, _ in runs]
    assert r["response_len"] == len(mask)

    # Straight from verl's tokens: the same positions, plus the fingerprint.
    r2, s2 = _ingest(tmp_path, {**base, "messages": messages, "response_mask": mask,
                                "response_ids": response}, "trainer")
    assert r2["policy_spans"] == r["policy_spans"]
    assert s2["n_tokens"].to_list() == s["n_tokens"].to_list()
    assert r2["response_fingerprint"] == fingerprint(response)

    # The natural misreading: the header and trailing newline counted with each assistant
    # message. Measured: how many step tokens then sit on positions verl masks out.
    header = len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    wrong = [messages[0], {**messages[1], "n_tokens": gen[0] + header + 1},
             {**messages[2], "n_tokens": block - header - 1},
             {**messages[3], "n_tokens": gen[1] + header}]
    _, s3 = _ingest(tmp_path, {**base, "messages": wrong}, "misread")
    on_masked = sum(int(np.sum(np.asarray(mask)[st:st + n] == 0)) + max(0, st + n - len(mask))
                    for st, n in zip(s3["token_start"], s3["n_tokens"]))
    print(f"\nheader counted with the assistant message: {on_masked} step tokens on positions "
          "verl's mask excludes")
    assert on_masked > 0


def test_tokenizer_counts_follow_the_convention_for_chatml(tmp_path):
    """--tokenizer PATH with a ChatML tokenizer.json: no counts in the log, and the positions
    still land exactly on verl's mask (text-only counts drifted by the template tokens)."""
    tok = chatml_tokenizer()
    messages, _, mask, replies, obs = _conversation(tok, obs_role="user")
    path = tmp_path / "tokenizer.json"
    tok.backend_tokenizer.save(str(path))
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"rollout_id": "r", "task_id": "t", "messages": messages}) + "\n")
    ingest("openai-jsonl", [log], tmp_path / "out", tokenizer=str(path))
    r = pl.read_parquet(tmp_path / "out" / "rollouts.parquet").row(0, named=True)
    runs = mask_runs(mask)
    assert r["policy_spans"] == [list(x) for x in runs]
    assert r["response_len"] == len(mask)
    text_only = len(tok.encode(replies[0], add_special_tokens=False)) + \
        len(tok.encode(obs[0], add_special_tokens=False))
    print(f"\ntext-only counts put turn 2 at token {text_only}, verl at {runs[1][0]}")
    assert text_only != runs[1][0]
