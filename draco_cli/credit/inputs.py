"""Credit's inputs as arrays (SPEC §3.3–3.6): steps indexed by rollout (``StepArrays``),
verdicts placed on their rollouts, integer codes of ids, and the checks that steps run 1..M
and verdict keys are unique. No per-rollout Python loops: per-rollout sums are bincounts or
reductions over offsets."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from draco_cli.errors import InputError, UsageError



def narrow_judge(verdicts: pl.DataFrame, judge: str | None, source: str = "verdicts",
                 option: str = "--judge") -> pl.DataFrame:
    """Keep one judge's verdicts. Mixing judges in one computation is an error (SPEC §3.3);
    ``option`` is the command's name for the choice."""
    judges = sorted(verdicts["judge"].unique().to_list())
    if judge is not None:
        if judge not in judges:
            raise UsageError(f"{option} {judge!r}: {source} has judges "
                             f"{', '.join(judges) or 'none'}")
        return verdicts.filter(pl.col("judge") == judge)
    if len(judges) > 1:
        raise UsageError(f"{source} holds verdicts of several judges ({', '.join(judges)}); "
                         f"choose one with {option} LABEL")
    return verdicts


def attach_groups(verdicts: pl.DataFrame, rollouts: pl.DataFrame, source: str) -> pl.DataFrame:
    """Add group_id (and ``__r``, the rollout's row in ``rollouts``) to verdicts; a verdict for
    a rollout not in ``rollouts`` is an error."""
    require_groups(rollouts)
    verdicts = verdicts.drop("group_id", "__r", strict=False)
    r = pl.Series("__r", verdict_rows(verdicts, rollouts, source), dtype=pl.UInt32)
    return verdicts.with_columns(r, rollouts["group_id"].gather(r).alias("group_id"))


def require_groups(rollouts: pl.DataFrame) -> None:
    """Every rollout has a group_id. A file's rollouts are checked against the contract; frames
    built in memory are not, and a null group would pool its rollouts into one baseline."""
    if rollouts["group_id"].null_count():
        row = int(rollouts["group_id"].is_null().arg_true()[0])
        raise InputError(f"rollout {rollouts['rollout_id'][row]!r} has no group_id",
                         file="rollouts", row=row, field="group_id")


def verdict_rows(verdicts: pl.DataFrame, rollouts: pl.DataFrame, source: str) -> np.ndarray:
    """Row in ``rollouts`` of each verdict's rollout (int64); a verdict for a rollout not in
    ``rollouts`` is an error. Verdicts in the rollouts' order need no string join."""
    lengths = rows_per_rollout(verdicts["rollout_id"], rollouts["rollout_id"])
    if lengths is not None:
        return np.repeat(np.arange(lengths.size), lengths)
    return _rollout_index(verdicts["rollout_id"], rollouts, source, "verdict for")


def _codes(values: pl.Series) -> tuple[np.ndarray, int] | None:
    """Integer codes of a column's values (hashed once; in order of first appearance) and how
    many distinct values there are; None when it holds nulls."""
    if values.null_count():
        return None
    encoded = cast("pa.DictionaryArray[Any, Any]", pc.dictionary_encode(values.to_arrow()))
    return encoded.indices.to_numpy().astype(np.int64), len(encoded.dictionary)


def clean_strings(col: pa.ChunkedArray[Any] | None) -> bool:
    """A string column without nulls: all the contract asks of an id column."""
    return col is not None and col.null_count == 0 and (
        pa.types.is_string(col.type) or pa.types.is_large_string(col.type))


VERDICT_FLAGS = ("pass", "fail", "na")


def verdict_flags(verdict: pl.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(is pass, is fail, is na) of each verdict as numpy bools, null = all False: the filter,
    the rewards and the citations share them instead of comparing 6M strings each."""
    return cast("tuple[np.ndarray, np.ndarray, np.ndarray]", tuple(
        (verdict == x).fill_null(False).to_numpy() for x in VERDICT_FLAGS))


def _check_verdict_keys(verdicts: pl.DataFrame, rows: np.ndarray | None, source: str,
                        crits: tuple[np.ndarray, int] | None = None) -> None:
    """Verdict keys (rollout_id, criterion_id, judge) are unique. With ``rows`` (the verdicts'
    rollout rows) and ``crits`` (criterion codes) of one judge's verdicts, integer (rollout row,
    criterion) pairs are checked first; the exact string check runs otherwise, and names the
    repeat."""
    from draco_cli.io import conform
    from draco_cli.schemas import VerdictAggregated

    if crits is not None and rows is not None:  # callers pass rows for one judge only
        c, n_c = crits
        if pl.Series(rows * max(n_c, 1) + c).n_unique() == verdicts.height:
            return
    conform(verdicts, VerdictAggregated, source, only=[],
            check_keys=True)


@dataclass
class StepArrays:
    """Steps sorted by (rollout, step) as numpy columns; ``r`` indexes the rollouts frame.

    ``offsets[i]:offsets[i + 1]`` are rollout i's steps, so per-rollout sums are bincounts and
    no per-rollout Python loop is needed anywhere.
    """

    rollout_ids: pl.Series  # per rollout
    r: np.ndarray  # per step: rollout index (int64)
    step: np.ndarray  # int32
    n: np.ndarray  # int32
    token_start: np.ndarray  # int32, -1 where null
    offsets: np.ndarray  # per rollout, length R + 1
    # the steps' own rollout_id column when they came already sorted (it is then the
    # per-step id; reusing it spares gathering millions of strings). A caller that kept the
    # file's Arrow column may put that here instead: output tables are then built without a
    # rollout_id column and the caller adds the Arrow column when writing (no conversion of
    # 20M ids to polars and back; a table used without it fails on the missing column
    # rather than carrying wrong ids).
    step_rollout_ids: pl.Series | pa.ChunkedArray[Any] | None = None

    @functools.cached_property
    def M(self) -> np.ndarray:
        """Steps per rollout (computed once: block loops slice it many times)."""
        return np.diff(self.offsets)

    def order(self) -> pl.DataFrame:
        """rollout_id and step of the sorted steps, for output tables (step alone when the ids
        are the caller's Arrow column, see ``step_rollout_ids``)."""
        step = pl.Series("step", self.step, dtype=pl.Int32)
        ids = self.step_rollout_ids
        if isinstance(ids, pa.ChunkedArray):
            return pl.DataFrame([step])
        if ids is None:
            ids = self.rollout_ids.gather(pl.Series(self.r))
        return pl.DataFrame({"rollout_id": ids, "step": step})


def rows_per_rollout(ids: pl.Series | pa.Array[Any] | pa.ChunkedArray[Any] | None,
                     rollout_ids: pl.Series | pa.Array[Any]) -> np.ndarray | None:
    """How many of ``ids`` each rollout of ``rollout_ids`` has, when they come grouped by
    rollout in the rollouts' order, as ingest and the judge write steps and verdicts (a
    rollout may have none); None otherwise, or when an id is null or not a rollout's. One
    run-end encoding: no id string is hashed against the rollouts unless some rollout has
    no rows. ``rollout_ids`` as Arrow must be large_string."""
    known = large_strings(rollout_ids) if isinstance(rollout_ids, pl.Series) else rollout_ids
    R = len(known)
    if isinstance(ids, pl.Series):
        ids = large_strings(ids) if ids.dtype == pl.String else None
    if isinstance(ids, pa.Array):
        ids = pa.chunked_array([ids])
    if ids is None or not clean_strings(ids) or known.null_count:
        return None
    if len(ids) == 0:
        return np.zeros(R, dtype=np.int64)
    length, value = arrow_runs(ids)
    if len(value) == R and pc.all(pc.equal(value, known)).as_py():
        return length  # one run per rollout: no hashing
    row = pc.index_in(value, value_set=known)
    if row.null_count:  # a row of an unknown rollout
        return None
    rows = row.to_numpy().astype(np.int64)
    if rows.size > 1 and not bool(np.all(rows[1:] > rows[:-1])):  # out of order, or split
        return None
    lengths = np.zeros(R, dtype=np.int64)
    lengths[rows] = length
    return lengths


def _rollout_index(rid: pl.Series, rollouts: pl.DataFrame, source: str,
                   what: str = "step of") -> np.ndarray:
    """Row of each of ``rid``'s rollouts in ``rollouts`` (int64), or an error naming the first
    row whose rollout is unknown.

    Logs keep a rollout's rows together, so the string join runs over the first row of each
    run of equal rollout_id (one per rollout) instead of over every row. (Callers have tried
    the cheaper case, one run per rollout in the rollouts' order, first.)
    """
    if rid.len() == 0:
        return np.zeros(0, dtype=np.int64)
    head = (rid != rid.shift(1)).fill_null(True).to_numpy()
    run = np.cumsum(head) - 1
    heads = pl.DataFrame({"rollout_id": rid.filter(pl.Series(head)),
                          "__run": np.arange(int(head.sum()))})
    idx = rollouts.select("rollout_id").with_row_index("__r")
    joined = heads.join(idx, on="rollout_id", how="left", maintain_order="left")
    missing = joined["__r"].is_null().to_numpy()
    if missing.any():
        first_run = int(np.flatnonzero(missing)[0])
        row = int(np.flatnonzero(run == first_run)[0])
        raise InputError(f"{what} unknown rollout {rid[row]!r}", file=source, row=row,
                         field="rollout_id")
    owner: np.ndarray = joined["__r"].to_numpy().astype(np.int64)[run]
    return owner


def large_strings(values: pl.Series) -> pa.Array[Any]:
    """A polars string column as one Arrow large_string array (what ``arrow_runs`` gives)."""
    return values.to_arrow().cast(pa.large_string())


def arrow_runs(ids: pa.ChunkedArray[Any]) -> tuple[np.ndarray, pa.Array[Any]]:
    """(length, value) of each run of equal values of a non-empty Arrow string column without
    nulls, values as large_string (one run-end encoding per chunk; runs cut by chunk bounds
    are joined)."""
    lengths, values = [], []
    for chunk in ids.chunks:
        if len(chunk) == 0:
            continue
        ree = pc.run_end_encode(chunk)  # type: ignore[attr-defined]  # not in the stubs
        ends = ree.run_ends.to_numpy().astype(np.int64)
        lengths.append(np.diff(ends, prepend=0))
        values.append(ree.values.cast(pa.large_string()))
    length = np.concatenate(lengths)
    value = pa.chunked_array(values).combine_chunks()
    if len(value) > 1:  # a run cut by a chunk bound continues in the next chunk
        same = pc.equal(value.slice(0, len(value) - 1), value.slice(1)).to_numpy(
            zero_copy_only=False)
        if same.any():
            head = np.concatenate([[True], ~same])
            length = np.add.reduceat(length, np.flatnonzero(head))
            value = value.filter(pa.array(head))
    return length, value


def index_steps(steps: pl.DataFrame, rollouts: pl.DataFrame, source: str,
                ids: pa.ChunkedArray[Any] | None = None) -> StepArrays:
    """Sort steps by rollout (in ``rollouts`` order) and step; check they belong to known
    rollouts and run 1..M without gaps or repeats.

    ``ids`` is the steps' rollout_id as read (Arrow, no nulls) when ``steps`` leaves it out:
    steps in the rollouts' order never convert it to polars."""
    R = rollouts.height
    # the columns' own buffers when they are int32 already (read-only views: nothing below
    # writes into them)
    step = steps["step"].to_numpy().astype(np.int32, copy=False)
    n = steps["n_tokens"].to_numpy().astype(np.int32, copy=False)
    token_start = (steps["token_start"].fill_null(-1).to_numpy().astype(np.int32, copy=False)
                   if "token_start" in steps.columns else np.full(step.size, -1, dtype=np.int32))
    offsets = np.zeros(R + 1, dtype=np.int64)
    lengths = rows_per_rollout(ids if ids is not None else steps["rollout_id"],
                               rollouts["rollout_id"])
    rows = None
    if lengths is not None:  # grouped by rollout, in order: offsets are the runs' bounds
        np.cumsum(lengths, out=offsets[1:])
        r = np.repeat(np.arange(R, dtype=np.int64), lengths)
        # numbered 1..M in place means sorted too: the check below is then done
        bad = _misnumbered(step, offsets)
    else:
        bad = -1
    if bad is not None and ids is not None:  # off the fast path: the ids as polars
        steps = steps.with_columns(cast(pl.Series, pl.from_arrow(ids)).alias("rollout_id"))
        ids = None
    if lengths is None:
        r = _rollout_index(steps["rollout_id"], rollouts, source)
    if bad is not None:
        if r.size > 1 and not bool(np.all((r[1:] > r[:-1])
                                          | ((r[1:] == r[:-1]) & (step[1:] > step[:-1])))):
            rows = np.lexsort((step, r))
            r, step, n, token_start = r[rows], step[rows], n[rows], token_start[rows]
        np.cumsum(np.bincount(r, minlength=R), out=offsets[1:])
        bad = _misnumbered(step, offsets)
    if bad is not None:
        rid = rollouts["rollout_id"][int(r[bad])]
        row = int(np.flatnonzero(steps["rollout_id"].to_numpy() == rid)[0])
        raise InputError(f"steps of rollout {rid!r} do not run 1..M without gaps or repeats",
                         file=source, row=row, field="step")
    step_ids: pl.Series | pa.ChunkedArray[Any] | None = None
    if rows is None:
        step_ids = ids if ids is not None else steps["rollout_id"].alias("rollout_id")
    return StepArrays(rollout_ids=rollouts["rollout_id"], r=r, step=step, n=n,
                      token_start=token_start, offsets=offsets, step_rollout_ids=step_ids)


def _misnumbered(step: np.ndarray, offsets: np.ndarray) -> int | None:
    """First position of sorted steps (rollout i's at ``offsets[i]:offsets[i + 1]``) whose
    number is not its place in its rollout (1, 2, 3, ...), or None: a rollout's first step
    must be 1 and each next step one more than the one before."""
    if step.size == 0:
        return None
    # The common case in a few whole-array passes: each step one more than the one before,
    # but where a rollout begins (then it must be 1). The search below runs only on failure.
    d = np.diff(step)
    begins = offsets[1:-1]
    d[begins[(begins > 0) & (begins < step.size)] - 1] = 1
    if step[0] == 1 and bool(np.all(d == 1)) and bool(np.all(step[begins[begins < step.size]] == 1)):
        return None
    del d
    firsts = offsets[:-1][np.diff(offsets) > 0]
    bad_first = firsts[step[firsts] != 1]
    jumps = np.flatnonzero(np.diff(step) != 1) + 1  # a rollout's first step aside
    head = np.zeros(step.size, dtype=bool)
    head[firsts] = True
    bad_next = jumps[~head[jumps]]
    if bad_first.size == 0 and bad_next.size == 0:
        return None
    return int(min(bad_first.min(initial=step.size), bad_next.min(initial=step.size)))


CHUNK_STEPS = 1 << 20  # steps per block: temporaries stay small and their memory is reused


def rollout_chunks(offsets: np.ndarray, target: int | None = None,
                   ) -> Iterator[tuple[int, int, int, int]]:
    """(first rollout, end rollout, first step, end step) blocks of about ``target`` steps
    (default CHUNK_STEPS), cut at rollout boundaries: per-rollout sums never straddle blocks."""
    target = target or CHUNK_STEPS
    R = offsets.size - 1
    total = int(offsets[-1])
    cuts = np.searchsorted(offsets, np.arange(target, total, target), side="right") - 1
    bounds = np.unique(np.concatenate([[0], cuts, [R]]))
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        yield int(r0), int(r1), int(offsets[r0]), int(offsets[r1])


def sum_by_offsets(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Integer sums of ``values[offsets[i]:offsets[i + 1]]`` for every i, exactly (in int64,
    one pass over the values, empty ranges 0)."""
    sums = np.zeros(offsets.size - 1, dtype=np.int64)
    nonempty = np.flatnonzero(offsets[1:] > offsets[:-1])
    if nonempty.size:
        # a non-empty range runs to the next non-empty one's start (empty ones between
        # start where it ends), the last one to offsets[-1]
        sums[nonempty] = np.add.reduceat(values[:int(offsets[-1])], offsets[nonempty],
                                         dtype=np.int64)
    return sums
