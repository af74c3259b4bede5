"""The integer-coded fast paths of credit compute give exactly what the general (string-keyed
or per-span) paths give, on random inputs that include the odd cases: nulls, empty and
misnumbered step runs, repeated and out-of-range citations, duplicate verdict keys, spans out
of order or past response_len."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from draco_cli.credit.core import citation_arrays
from draco_cli.credit.inputs import (StepArrays, _check_verdict_keys, _codes, _misnumbered,
                                     index_steps)
from draco_cli.errors import InputError
from draco_cli.io import conform
from draco_cli.schemas import VerdictAggregated
from draco_cli.validate import flat_policy_spans, policy_span_issues

SPANS = pa.list_(pa.list_(pa.int32()))


def random_spans(rng: np.random.Generator, n: int) -> tuple[list, list]:
    rows, resp = [], []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.1:
            rows.append(None)
        else:
            k = int(rng.integers(0, 5))
            starts = np.sort(rng.integers(-1 if kind < 0.15 else 0, 40, size=k))
            spans = [[int(s), int(s + rng.integers(-1 if kind < 0.2 else 1, 8))] for s in starts]
            if kind > 0.95 and spans:
                spans[0] = spans[0][:1]  # not a pair
            if 0.9 < kind <= 0.95 and spans:
                spans[-1] = [spans[-1][0], None]  # a null bound
            if 0.85 < kind <= 0.9:
                spans = spans[::-1]  # out of order
            rows.append(spans)
        resp.append(None if rng.random() < 0.2 else int(rng.integers(0, 50)))
    return rows, resp


def span_issues_by_loop(rows: list, resp: list | None) -> list:
    """policy_span_issues' rules, one span at a time: a malformed span hides the rest, then a
    null bound, then every other rule."""
    from draco_cli.validate.issues import _issue

    def found(pred, what):
        return _issue(np.array([i for i, sp in enumerate(rows) for k, x in enumerate(sp or [])
                                if pred(i, sp, k, x)], dtype=np.int64), what)

    shape = found(lambda i, sp, k, x: x is None or len(x) != 2,
                  "a span must be a [start, end) pair")
    if shape:
        return shape
    null = found(lambda i, sp, k, x: None in x, "a span bound is null")
    if null:
        return null
    out = found(lambda i, sp, k, x: x[0] < 0 or x[1] <= x[0],
                "span with start < 0 or end <= start")
    if resp is not None:
        out += found(lambda i, sp, k, x: resp[i] is not None and x[1] > resp[i],
                     "span ends past response_len")
    return out + found(lambda i, sp, k, x: k > 0 and x[0] < sp[k - 1][1],
                       "spans overlap or are out of order")


@pytest.mark.parametrize("seed", range(40))
def test_span_check_matches_a_loop(seed):
    rng = np.random.default_rng(seed)
    rows, resp = random_spans(rng, int(rng.integers(1, 30)))
    arr = pa.array(rows, type=SPANS)
    resp_s = pl.Series(resp, dtype=pl.Int32)
    # as one array, as chunks, and as a slice (offsets not starting at 0)
    cut = len(rows) // 2
    for spans in (arr, pa.chunked_array([arr.slice(0, cut), arr.slice(cut)]),
                  pa.array([[[0, 1]]] + rows, type=SPANS).slice(1)):
        assert policy_span_issues(spans, resp_s) == span_issues_by_loop(rows, resp)
        assert policy_span_issues(spans) == span_issues_by_loop(rows, None)


def test_flat_spans_are_views_of_well_formed_pairs():
    arr = pa.array([[[0, 5], [7, 9]], None, [], [[1, 2]]], type=SPANS)
    flat = flat_policy_spans(arr)
    assert flat is not None
    assert flat.offsets.tolist() == [0, 2, 2, 2, 3]
    assert flat.start.tolist() == [0, 7, 1] and flat.end.tolist() == [5, 9, 2]
    assert flat_policy_spans(pa.array([[[0, 5, 6]]], type=SPANS)) is None
    assert flat_policy_spans(pa.array([[[0, None]]], type=SPANS)) is None


@pytest.mark.parametrize("seed", range(60))
def test_misnumbered_finds_the_first_step_out_of_place(seed):
    rng = np.random.default_rng(seed)
    M = rng.integers(0, 5, size=int(rng.integers(1, 12)))
    offsets = np.concatenate([[0], np.cumsum(M)]).astype(np.int64)
    step = np.concatenate([np.arange(1, m + 1) for m in M] + [np.zeros(0)]).astype(np.int32)
    if step.size and rng.random() < 0.7:
        for _ in range(int(rng.integers(1, 3))):
            step[rng.integers(0, step.size)] = rng.integers(0, 6)
    r = np.repeat(np.arange(M.size), M)
    expected = np.flatnonzero(step != np.arange(step.size) - offsets[r] + 1)
    assert _misnumbered(step, offsets) == (int(expected[0]) if expected.size else None)


def random_verdicts(rng: np.random.Generator, R: int, with_nulls: bool = True):
    groups = [f"g{i // 3}" for i in range(R)]
    rollouts = pl.DataFrame({"rollout_id": [f"r{i}" for i in range(R)], "group_id": groups})
    rows = []
    for i in range(R):
        for c in rng.choice(6, size=int(rng.integers(0, 5)), replace=False):
            v = rng.choice(["pass", "fail", "na", None] if with_nulls else ["pass", "fail", "na"])
            rows.append((f"r{i}", f"c{c}" if rng.random() < 0.8 else f"{groups[i]}-c{c}", v,
                         [int(x) for x in rng.integers(-1, 6, size=int(rng.integers(0, 4)))]))
    verdicts = pl.DataFrame(rows, schema={"rollout_id": pl.String, "criterion_id": pl.String,
                                          "verdict": pl.String, "cited_steps": pl.List(pl.Int32)},
                            orient="row")
    return rollouts, verdicts.with_columns(pl.lit("frontier").alias("judge"))


@pytest.mark.parametrize("seed", range(30))
def test_verdict_key_check_matches_the_contract_check(seed):
    rng = np.random.default_rng(seed)
    rollouts, verdicts = random_verdicts(rng, int(rng.integers(1, 15)), with_nulls=False)
    if verdicts.height and rng.random() < 0.6:  # repeat a row somewhere after it
        i = int(rng.integers(0, verdicts.height))
        j = int(rng.integers(i + 1, verdicts.height + 1))
        verdicts = pl.concat([verdicts[:j], verdicts[i:i + 1], verdicts[j:]])
    rows = pl.DataFrame({"rollout_id": rollouts["rollout_id"]}).with_row_index("r").join(
        verdicts.select("rollout_id"), on="rollout_id", maintain_order="right")["r"].to_numpy()

    def outcome(check):
        try:
            check()
        except InputError as exc:
            return str(exc)
        return None

    ours = outcome(lambda: _check_verdict_keys(verdicts, rows.astype(np.int64), "v.parquet",
                                               _codes(verdicts["criterion_id"])))
    theirs = outcome(lambda: conform(verdicts, VerdictAggregated, "v.parquet", only=[]))
    assert ours == theirs


def reference_citations(sa: StepArrays, verdicts: pl.DataFrame):
    p, f = np.zeros(sa.r.size, np.int32), np.zeros(sa.r.size, np.int32)
    dropped = 0
    for r, verdict, cites, kept in verdicts.select("__r", "verdict", "cited_steps",
                                                   "retained").iter_rows():
        if not kept or verdict not in ("pass", "fail"):
            continue
        M = int(sa.offsets[r + 1] - sa.offsets[r])
        valid = [c for c in cites if 1 <= c <= M]
        dropped += len(cites) - len(valid)
        for c in set(valid):
            (p if verdict == "pass" else f)[sa.offsets[r] + c - 1] += 1
    return p, f, dropped


@pytest.mark.parametrize("seed", range(30))
def test_citation_counts_match_a_loop(seed):
    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 20))
    rollouts, verdicts = random_verdicts(rng, R)
    M = rng.integers(0, 6, size=R)
    steps = pl.DataFrame({"rollout_id": [f"r{i}" for i in range(R) for _ in range(M[i])],
                          "step": [s + 1 for i in range(R) for s in range(M[i])],
                          "n_tokens": [3] * int(M.sum())},
                         schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32})
    sa = index_steps(steps, rollouts, "steps")
    rows = pl.DataFrame({"rollout_id": rollouts["rollout_id"]}).with_row_index("r").join(
        verdicts.select("rollout_id"), on="rollout_id", maintain_order="right")["r"]
    verdicts = verdicts.with_columns(rows.alias("__r"),
                                     pl.Series("retained", rng.random(verdicts.height) < 0.8))
    p, f, dropped = citation_arrays(sa, verdicts)
    rp, rf, rdropped = reference_citations(sa, verdicts)
    assert p.tolist() == rp.tolist() and f.tolist() == rf.tolist() and dropped == rdropped


@pytest.mark.parametrize("seed", range(12))
def test_rows_per_rollout_match_a_loop(seed):
    """Rows per rollout read off an Arrow column in chunks (runs cut by chunk bounds, repeats,
    rollouts out of order, missing or unknown ones) agree with a loop, and with the same ids
    as polars."""
    from draco_cli.credit.inputs import rows_per_rollout

    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 8))
    names = [f"r{i}" for i in range(R)]
    rollout_ids = pl.Series("rollout_id", names)
    M = rng.integers(1, 5, R)
    ids = np.repeat(np.array(names, dtype=object), M)
    shape = seed % 5
    if shape == 1:  # a rollout's steps split in two runs
        ids = np.concatenate([ids, ids[:1]])
    elif shape == 2:  # a rollout without steps
        ids = ids[ids != f"r{R - 1}"]
    elif shape == 3:  # rollouts' runs in another order
        ids = ids[::-1]
    elif shape == 4:  # a step of an unknown rollout
        ids = np.concatenate([ids, ["nobody"]])
    cuts = np.sort(rng.integers(0, ids.size + 1, int(rng.integers(0, 4))))
    chunks = [pa.array(list(part), pa.string()) for part in np.split(ids, cuts)]
    a = rows_per_rollout(pa.chunked_array(chunks, pa.string()), rollout_ids)
    b = rows_per_rollout(pl.Series(list(ids), dtype=pl.String), rollout_ids)
    # the loop: each id a known rollout's, every rollout's rows adjacent, in the rollouts' order
    order = [names.index(x) if x in names else None for x in ids]
    grouped = None not in order and all(
        x <= y for x, y in zip(order, order[1:]))
    expected = [int(np.sum(ids == n)) for n in names] if grouped else None
    assert (None if a is None else a.tolist()) == expected
    assert (None if b is None else b.tolist()) == expected


@pytest.mark.parametrize("seed", range(20))
def test_sums_by_offsets_match_a_running_sum(seed):
    """Per-rollout integer sums (empty rollouts, extreme int32 values, values past the last
    offset) equal differences of a running int64 sum."""
    from draco_cli.credit.inputs import sum_by_offsets as _sum_by_offsets

    rng = np.random.default_rng(seed)
    for _ in range(50):
        M = rng.integers(0, 4, int(rng.integers(0, 10)))
        offsets = np.concatenate([[0], np.cumsum(M)]).astype(np.int64)
        values = rng.integers(-2**31, 2**31 - 1, int(offsets[-1]) + int(rng.integers(0, 3)),
                              dtype=np.int64).astype(np.int32)
        running = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        expected = running[offsets[1:]] - running[offsets[:-1]]
        assert _sum_by_offsets(values, offsets).tolist() == expected.tolist()


def reference_token_spans(R, M, n, ts, rsp, adv, rids, steps):
    """token_spans under step credit, rollout by rollout: (length, layout, spans) or the
    error for a step past response_len."""
    out, k = [], 0
    for i in range(R):
        idx = list(range(k, k + M[i]))
        k += M[i]
        pos = all(ts[j] >= 0 for j in idx) if idx else rsp[i] >= 0
        spans, at = [], 0
        for j in idx:
            s = ts[j] if pos else at
            at += n[j]
            if pos and rsp[i] >= 0 and s + n[j] > rsp[i]:
                return (f"step {steps[j]} of rollout {rids[i]!r} ends at token {s + n[j]}, "
                        f"past its response_len {rsp[i]}")
            spans.append([s, s + n[j], np.float32(adv[j])])
        length = (rsp[i] if rsp[i] >= 0 else max([e for _, e, _ in spans], default=0)) \
            if pos else sum(n[j] for j in idx)
        merged = []
        for s, e, v in spans:
            if v == 0:
                continue
            if merged and merged[-1][1] == s and merged[-1][2] == v:
                merged[-1][1] = e
            else:
                merged.append([s, e, v])
        out.append((length, "positions" if pos else "end_to_end", merged))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_token_spans_match_a_loop(seed):
    """Spans by blocks (positions and end-to-end layouts mixed, null response_len, steps that
    touch, zero values, a step past response_len) equal a rollout-by-rollout loop."""
    from draco_cli.credit.tokens import token_spans

    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 12))
    M = [int(x) for x in rng.integers(0, 4, R)]
    total = sum(M)
    n = [int(x) for x in rng.integers(1, 5, total)]
    ts, k = [], 0
    for i in range(R):
        at = int(rng.integers(0, 3))
        for _ in range(M[i]):
            ts.append(at if rng.random() > 0.08 else -1)
            at += n[k] + int(rng.integers(0, 2))  # steps that touch or leave a gap
            k += 1
    rsp = [int(rng.integers(0, 30)) if rng.random() < 0.6 else -1 for _ in range(R)]
    adv = [float(rng.choice([0.0, 0.5, -1.25])) for _ in range(total)]
    rids = [f"r{i}" for i in range(R)]
    steps = [s + 1 for i in range(R) for s in range(M[i])]
    rollouts = pl.DataFrame({"rollout_id": rids,
                             "response_len": pl.Series([x if x >= 0 else None for x in rsp],
                                                       dtype=pl.Int32)})
    step_frame = pl.DataFrame({"rollout_id": [rids[i] for i in range(R) for _ in range(M[i])],
                               "step": steps, "n_tokens": n,
                               "token_start": [x if x >= 0 else None for x in ts]},
                              schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32,
                                                "token_start": pl.Int32})
    sa = index_steps(step_frame, rollouts, "steps")
    expected = reference_token_spans(R, M, n, ts, rsp, adv, rids, steps)
    try:
        ta = token_spans(rollouts, sa, np.array(adv), np.zeros(R), np.full(R, "step"))
    except InputError as exc:
        assert isinstance(expected, str) and expected in str(exc)
        return
    assert not isinstance(expected, str), expected
    got = [(length, layout, [[s, e, np.float32(v)] for s, e, v in zip(a, b, c)])
           for length, layout, a, b, c in ta.select(
               "length", "layout", "span_start", "span_end", "span_value").iter_rows()]
    assert got == expected


@pytest.mark.parametrize("seed", range(10))
def test_integer_sums_equal_the_float_bincounts_bit_for_bit(seed):
    """step_credit_arrays sums cited flags and token counts as integers: as floats they must
    equal the float-weighted bincounts they replace, bit for bit (empty rollouts included)."""
    from draco_cli.credit.inputs import sum_by_offsets as _sum_by_offsets

    rng = np.random.default_rng(seed)
    M = rng.integers(0, 30, int(rng.integers(1, 200)))
    offsets = np.concatenate([[0], np.cumsum(M)]).astype(np.int64)
    r = np.repeat(np.arange(M.size), M)
    for values in (rng.random(r.size) < 0.4, rng.integers(0, 2**31 - 1, r.size, dtype=np.int64).astype(np.int32)):
        ours = _sum_by_offsets(values, offsets).astype(np.float64)
        theirs = np.bincount(r, weights=values.astype(np.float64), minlength=M.size)
        assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("seed", range(10))
def test_step_credit_shortcuts_are_bit_equal(seed):
    """step_credit_arrays drops two selects: Q = p / max(p + f, 1) needs no select for uncited
    steps, and Σw over rollouts without a cited step is set to 0 instead of summing NaN set
    to 0. Both give the same bits as the selects, rollouts without steps or citations
    included."""
    rng = np.random.default_rng(seed)
    M = rng.integers(0, 12, int(rng.integers(1, 300)))
    r = np.repeat(np.arange(M.size), M)
    p = rng.integers(0, 3, r.size).astype(np.int32)
    f = rng.integers(0, 3, r.size).astype(np.int32)
    uncited = np.repeat(rng.random(M.size) < 0.3, M)
    p[uncited], f[uncited] = 0, 0
    c = (p + f) > 0
    assert (p / np.maximum(p + f, 1)).tobytes() == np.where(c, p / np.maximum(p + f, 1),
                                                             0.0).tobytes()
    with np.errstate(invalid="ignore", divide="ignore"):
        q = p / np.maximum(p + f, 1)
        n_cited = np.bincount(r, weights=c, minlength=M.size)
        qbar = np.bincount(r, weights=q, minlength=M.size) / n_cited
        qual = np.where(c, q, qbar[r])
        A = rng.standard_normal(M.size)[r]
        w = np.where(A >= 0, qual, 1.0 - qual)
        ours = np.bincount(r, weights=w, minlength=M.size)
        ours[n_cited == 0] = 0.0
        theirs = np.bincount(r, weights=np.nan_to_num(w), minlength=M.size)
    assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("seed", range(10))
def test_citation_counts_match_a_loop_with_long_lists(seed):
    """Citation counts with long lists (many repeats, steps out of range) equal a loop's."""
    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 10))
    rollouts = pl.DataFrame({"rollout_id": [f"r{i}" for i in range(R)],
                             "group_id": [f"g{i // 3}" for i in range(R)]})
    rows = [(f"r{i}", f"c{c}", str(rng.choice(["pass", "fail", "na"])),
             [int(x) for x in rng.integers(0, 7, size=int(rng.integers(0, 20)))])
            for i in range(R) for c in range(int(rng.integers(0, 4)))]
    verdicts = pl.DataFrame(rows, schema={"rollout_id": pl.String, "criterion_id": pl.String,
                                          "verdict": pl.String, "cited_steps": pl.List(pl.Int32)},
                            orient="row")
    M = rng.integers(0, 8, size=R)
    steps = pl.DataFrame({"rollout_id": [f"r{i}" for i in range(R) for _ in range(M[i])],
                          "step": [s + 1 for i in range(R) for s in range(M[i])],
                          "n_tokens": [3] * int(M.sum())},
                         schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32})
    sa = index_steps(steps, rollouts, "steps")
    r = pl.DataFrame({"rollout_id": rollouts["rollout_id"]}).with_row_index("r").join(
        verdicts.select("rollout_id"), on="rollout_id", maintain_order="right")["r"]
    verdicts = verdicts.with_columns(r.alias("__r"),
                                     pl.Series("retained", rng.random(verdicts.height) < 0.8))
    p, f, dropped = citation_arrays(sa, verdicts)
    rp, rf, rdropped = reference_citations(sa, verdicts)
    assert p.tolist() == rp.tolist() and f.tolist() == rf.tolist() and dropped == rdropped
