"""verifiers (0.4.0) traces and draco: per-token advantages in the compact layout (the nodes'
storage order, each node's sampled tokens in order: what prime-rl's ``assign_advantages``
fills). See docs/trainers.md, "verifiers and prime-rl". Functions take a verifiers ``Trace`` or
its JSON record (a dict from ``traces.jsonl``) alike; nothing here imports verifiers."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from draco_cli.errors import InputError, UsageError
from draco_cli.inloop.rows import TrainerRollout
from draco_cli.trainers import field_of
from draco_cli.trainers.export import ExportResult, advantages_file
from draco_cli.trainers.loader import AlignmentError, fingerprint, load_token_advantages

__all__ = ["CHECK_KEY", "TraceTokens", "assign_compact", "check_trace", "export", "fill_trace",
           "iter_records", "trace_outcome", "trace_rollout", "trace_tokens"]

CHECK_KEY = "draco"   # trace.info[CHECK_KEY]: the self-check an export leaves on each trace


def _set(obj: Any, name: str, value: Any) -> None:
    if isinstance(obj, dict):
        obj[name] = value
    else:
        setattr(obj, name, value)


@dataclass(frozen=True)
class TraceTokens:
    """draco's response of one trace: ``ids`` and 0/1 ``mask`` over the nodes from ``first``
    on; ``node_of`` the node index of each token; ``sampled`` (node index, sampled tokens) for
    every node holding any, in compact order."""

    trace_id: str
    first: int
    ids: np.ndarray
    mask: np.ndarray
    node_of: np.ndarray
    sampled: tuple[tuple[int, int], ...]

    @property
    def n_sampled(self) -> int:
        return int(self.mask.sum())


def trace_tokens(trace: Any) -> TraceTokens:
    """The trace's response ids and mask (docs/trainers.md, "verifiers and prime-rl"); an error
    naming the trace and node when a node's mask does not describe its tokens, or no token was
    sampled."""
    tid = str(field_of(trace, "id"))
    nodes = field_of(trace, "nodes") or []
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    node_of: list[np.ndarray] = []
    sampled: list[tuple[int, int]] = []
    first = -1
    for i, node in enumerate(nodes):
        tok = np.asarray(field_of(node, "token_ids") or [], dtype=np.int64)
        m = np.asarray(field_of(node, "mask") or [], dtype=bool)
        if len(tok) != len(m):
            raise AlignmentError(f"trace {tid!r} node {i}: mask has {len(m)} entries but "
                                 f"token_ids {len(tok)}: they must describe the same tokens")
        n = int(m.sum())
        if n and first < 0:
            first = i
        if first < 0:
            continue
        if n:
            sampled.append((i, n))
        ids.append(tok)
        mask.append(m.astype(np.int8))
        node_of.append(np.full(len(tok), i, dtype=np.int64))
    if first < 0:
        raise AlignmentError(f"trace {tid!r}: no sampled token (every node's mask is False): "
                             "nothing to credit")
    return TraceTokens(tid, first, np.concatenate(ids), np.concatenate(mask),
                       np.concatenate(node_of), tuple(sampled))


def message_text(message: Any) -> str:
    """A verifiers message as plain text: its content (text parts joined) and tool calls."""
    content = field_of(message, "content")
    if isinstance(content, list):
        text = "".join(str(field_of(p, "text", "") or "") for p in content)
    else:
        text = "" if content is None else str(content)
    calls = field_of(message, "tool_calls") or []
    for call in calls:
        fn = field_of(call, "function", call)
        text += f"\n{field_of(fn, 'name', '')}({field_of(fn, 'arguments', '')})"
    return text


def trace_outcome(trace: Any) -> float | None:
    """The trace's reward as verifiers sums it (score × weight over the scored rewards);
    None when no reward was scored."""
    rewards = [r for r in (field_of(trace, "rewards") or {}).values() if r is not None]
    if not rewards:
        return None
    return float(sum(float(field_of(r, "score")) * float(field_of(r, "weight", 1.0) or 1.0)
                     for r in rewards))


def task_id(trace: Any) -> str:
    task = field_of(trace, "task") or {}
    for key in ("key", "hash"):
        if field_of(task, key):
            return str(field_of(task, key))
    idx = field_of(field_of(task, "data") or {}, "idx")
    return f"idx-{idx}" if idx is not None else "task"


def trace_rollout(trace: Any, group_id: str, *, train_step: int | None = None,
                  row: int | None = None) -> TrainerRollout:
    """The trace as a ``TrainerRollout``: id ``trace.id``, the instruction the messages before
    its first sampled node, the outcome its reward."""
    tt = trace_tokens(trace)
    nodes = field_of(trace, "nodes") or []
    instruction = "\n\n".join(t for t in (message_text(field_of(n, "message"))
                                          for n in nodes[:tt.first]) if t)
    return TrainerRollout(tt.trace_id, group_id, instruction, tt.ids, tt.mask,
                          outcome=trace_outcome(trace), task_id=task_id(trace),
                          train_step=train_step, row=row)


def assign_compact(trace: Any, values: Sequence[float] | np.ndarray) -> None:
    """Fill the trace's sampled nodes from compact values: ``len(values)`` must equal the
    number of sampled tokens (the rule of prime-rl's ``assign_advantages``). Nodes without a
    sampled token keep ``advantages`` None."""
    _assign(trace, trace_tokens(trace), values)


def _assign(trace: Any, tt: TraceTokens, values: Sequence[float] | np.ndarray) -> None:
    if len(values) != tt.n_sampled:
        raise AlignmentError(f"trace {tt.trace_id!r}: {len(values)} advantages for "
                             f"{tt.n_sampled} sampled tokens")
    flat = np.asarray(values, dtype=np.float64).tolist()
    nodes = field_of(trace, "nodes")
    offset = 0
    for i, n in tt.sampled:
        _set(nodes[i], "advantages", flat[offset:offset + n])
        offset += n


def fill_trace(trace: Any, rollout_id: str, dense: np.ndarray | Sequence[float]) -> list[float]:
    """Fill ``trace``'s nodes from draco's dense advantages of rollout ``rollout_id`` (one
    value per response token, as ``StepScorer`` returns them): the id must be the trace's and
    the length its response's, else ``AlignmentError``. Returns the compact values."""
    tt = trace_tokens(trace)
    if rollout_id != tt.trace_id:
        raise AlignmentError(f"advantages of rollout {rollout_id!r} given to trace "
                             f"{tt.trace_id!r}: rows are matched by trace id")
    dense = np.asarray(dense)
    if dense.ndim != 1 or len(dense) != len(tt.ids):
        raise AlignmentError(f"trace {tt.trace_id!r}: {dense.shape} advantages for a response "
                             f"of {len(tt.ids)} tokens")
    stray = int(np.count_nonzero(dense[tt.mask == 0]))
    if stray:
        raise AlignmentError(f"trace {tt.trace_id!r}: advantages on {stray} tokens its mask "
                             "excludes: token positions are not the trace's")
    compact: list[float] = np.asarray(dense, dtype=np.float64)[tt.mask == 1].tolist()
    _assign(trace, tt, compact)
    return compact


def check_trace(trace: Any) -> None:
    """An exported trace still fits the advantages it carries: its sampled-token count and
    ids' fingerprint equal the self-check ``info["draco"]``, and each node's advantages have
    one value per sampled token."""
    tt = trace_tokens(trace)
    check = (field_of(trace, "info") or {}).get(CHECK_KEY)
    if check is None:
        raise AlignmentError(f"trace {tt.trace_id!r}: no info[{CHECK_KEY!r}] self-check "
                             "(not written by draco export)")
    if check["n_sampled"] != tt.n_sampled or check["response_fingerprint"] != fingerprint(
            tt.ids):
        raise AlignmentError(f"trace {tt.trace_id!r}: its tokens are not the ones draco "
                             f"scored ({tt.n_sampled} sampled tokens, expected "
                             f"{check['n_sampled']}; or another fingerprint)")
    nodes = field_of(trace, "nodes")
    for i, n in tt.sampled:
        adv = field_of(nodes[i], "advantages")
        if adv is not None and len(adv) != n:
            raise AlignmentError(f"trace {tt.trace_id!r} node {i}: {len(adv)} advantages "
                                 f"for {n} sampled tokens")


def iter_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, episode record) of a verifiers ``traces.jsonl`` (one ``Episode`` record a
    line, as ``write_episode`` and prime-rl's file monitor write them); a line holding a bare
    trace reads as an episode of that one trace."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"not JSON ({exc.msg})", file=str(path), row=n) from None
            if not isinstance(rec, dict) or not isinstance(
                    rec.get("traces", rec.get("nodes")), list):
                raise InputError("not a verifiers episode or trace record (no 'traces' list)",
                                 file=str(path), row=n, field="traces")
            yield n, rec if "traces" in rec else {"task": rec.get("task"), "traces": [rec]}


def record_step(episode: Mapping[str, Any]) -> int | None:
    """The train step prime-rl stamps on an episode (``run.work.step``), if any."""
    work = (episode.get("run") or {}).get("work") or {}
    step = work.get("step")
    return None if step is None else int(step)


def export(advantages: Path, out: Path, *, records: Path | None = None,
           force: bool = False) -> ExportResult:
    """``draco export --to verifiers``: ``records`` (a ``traces.jsonl``) written to ``out``
    with each scored trace's ``node.advantages`` filled (compact, full precision) and the
    self-check ``info["draco"]`` (sampled tokens, fingerprint, train step). Traces draco did
    not score keep ``advantages`` unassigned (None). Every scored trace is checked against the
    file first (id, train step, sampled-token count, fingerprint); a misfit is an error naming
    the record line, and nothing is written."""
    from draco_cli.io import check_writable, write_text_atomic

    if records is None:
        raise UsageError("--to verifiers needs --records: the traces.jsonl whose nodes to fill "
                         "(the compact layout is per message node)")
    table_path = advantages_file(advantages)
    check_writable(out, force)
    table = load_token_advantages(table_path)
    lines: list[str] = []
    filled = tokens = unscored = 0
    seen: set[str] = set()
    for n, episode in iter_records(records):
        step = record_step(episode)
        for trace in episode["traces"]:
            tid = str(trace.get("id"))
            if tid not in table:
                unscored += 1
                continue
            try:
                tt = trace_tokens(trace)
                dense = table.batch([tid], tt.mask[None, :],
                                    train_step=None if step is None else [step],
                                    response_ids=tt.ids[None, :])[0]
            except AlignmentError as exc:
                # one trace at a time: the loader's "trainer row 0" names nothing here
                raise InputError(str(exc).replace(" (trainer row 0)", ""), file=str(records),
                                 row=n, field="nodes") from None
            _assign(trace, tt, dense[tt.mask == 1])
            info = trace.setdefault("info", {})
            info[CHECK_KEY] = {"n_sampled": tt.n_sampled, "response_fingerprint":
                               fingerprint(tt.ids), "train_step": table.train_step(tid),
                               "source": str(table_path)}
            seen.add(tid)
            filled += 1
            tokens += tt.n_sampled
        lines.append(json.dumps(episode) + "\n")
    if not filled:
        raise InputError(f"no trace of these records is in {table_path} (matched by trace id)",
                         file=str(records))
    write_text_atomic(out, "".join(lines), force)
    notes = []
    if unscored:
        notes.append(f"{unscored} traces not in the advantages file: left unassigned (None)")
    if len(table) > len(seen):
        notes.append(f"{len(table) - len(seen)} rollouts of the advantages file are in no "
                     "record")
    return ExportResult(out, filled, tokens, notes)
