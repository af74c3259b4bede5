"""Checks of tables against their contracts and against each other (``draco validate``).

Unlike a read, which stops at the first broken rule, validation collects every problem it can
find, each naming file, row and field, so a user fixes a log in one pass.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from draco_cli.errors import InputError
from draco_cli.io import (JOURNAL_FILE, SET_ID_KEY, SET_MEMBERS_KEY, STDIO, as_frame, conform,
                         read_arrow)
from draco_cli.schemas import TABLES, Table

MAX_PER_RULE = 5  # rows listed per broken rule; the count says how many in all


def detect_table(path: str | Path, metadata: dict[bytes, bytes] | None) -> type[Table] | None:
    """The table a file holds: from the metadata draco writes, else from the file name."""
    name = (metadata or {}).get(b"draco.table")
    if name is not None and name.decode() in TABLES:
        return TABLES[name.decode()]
    stem = Path(path).name.split(".")[0]
    return TABLES.get(stem)


def _name(path: str | Path) -> str:
    return "<stdin>" if str(path) == "-" else str(path)


def _rows(df: pl.DataFrame, mask: pl.Expr) -> tuple[list[int], int]:
    idx = df.select(mask.arg_true()).to_series()
    return idx.head(MAX_PER_RULE).to_list(), idx.len()


def _report(problems: list[str], source: str, field: str, what: str, rows: list[int],
            n: int) -> None:
    if n:
        listed = ", ".join(str(r) for r in rows) + (f" and {n - len(rows)} more" if n > len(rows) else "")
        problems.append(f"{source}: row {listed}: field '{field}': {what}")


LLM_CALLS = "llm_calls.parquet"  # draco's export of a call log (draco_cli.llm.calllog)
LLM_CALLS_COLUMNS = ("request_hash", "phase", "status")


@dataclass
class Loaded:
    source: str
    model: type[Table] | None  # None: the call-log export
    df: pl.DataFrame
    metadata: dict[bytes, bytes]


class _Loader:
    """Reads each file once, however many sets it is context for."""

    def __init__(self) -> None:
        self.cache: dict[str, Loaded | str] = {}

    def __call__(self, path: str | Path) -> Loaded | str:
        """The checked table, or the problem that stopped reading it."""
        key = str(path)
        if key not in self.cache:
            self.cache[key] = self._load(path)
        return self.cache[key]

    def _load(self, path: str | Path) -> Loaded | str:
        try:
            arrow = read_arrow(path)
            meta = dict(arrow.schema.metadata or {})
            if Path(path).name == LLM_CALLS and b"draco.table" not in meta:
                df = as_frame(arrow)
                missing = [c for c in LLM_CALLS_COLUMNS if c not in df.columns]
                if missing:
                    return f"{path}: field '{missing[0]}': missing column of a draco call log"
                return Loaded(_name(path), None, df, meta)
            model = detect_table(path, meta)
            if model is None:
                return (f"{path}: cannot tell which table this is (name it after the table, "
                        f"e.g. rollouts.parquet, or write it with draco)")
            df = conform(as_frame(arrow), model, _name(path))
        except InputError as exc:
            return str(exc)
        return Loaded(_name(path), model, df, meta)


def validate_paths(paths: Sequence[str | Path], context: Sequence[str | Path] = (),
                   loader: _Loader | None = None) -> tuple[dict[str, int], list[str]]:
    """Validate files as one set; return (rows per table, problems). Tables are matched to
    their contract by metadata or file name (rollouts.parquet, steps.parquet, ...).

    ``context`` tables (e.g. a run's rollouts and steps, for its verdicts) take part in the
    checks across tables but are not themselves checked or counted here."""
    load = loader or _Loader()
    frames: dict[str, tuple[str, pl.DataFrame]] = {}
    own: set[str] = set()
    problems: list[str] = []
    counts: dict[str, int] = {}
    loaded: list[tuple[Path, Loaded]] = []
    manifests: list[Path] = []
    for path in paths:
        if Path(path).name == "manifest.json":
            manifests.append(Path(path))
            continue
        item = load(path)
        if isinstance(item, str):
            problems.append(item)
            continue
        name = "llm_calls" if item.model is None else item.model.table_name
        if name in frames:
            problems.append(f"{path}: a second '{name}' table (first: "
                            f"{frames[name][0]}); validate one set at a time")
            continue
        frames[name] = (item.source, item.df)
        own.add(name)
        counts[name] = item.df.height
        loaded.append((Path(path), item))
    for path in context:
        item = load(path)
        if not isinstance(item, str) and item.model is not None \
                and item.model.table_name not in frames:
            frames[item.model.table_name] = (item.source, item.df)
    problems += _table_checks(frames, own)
    problems += check_output_sets(loaded)
    for m in manifests:
        problems += check_manifest(m, counts, loaded)
    return counts, problems


def _table_checks(frames: dict[str, tuple[str, pl.DataFrame]], own: set[str]) -> list[str]:
    """The checks of each table of the set (``own``) alone and against the others."""
    problems: list[str] = []
    if "llm_calls" in own:
        problems += check_llm_calls(*frames["llm_calls"])
    if "rollouts" in own:
        problems += check_rollouts(*frames["rollouts"])
    if "steps" in own:
        problems += check_steps(*frames["steps"])
    if "rollouts" in frames and "steps" in frames and own & {"rollouts", "steps"}:
        problems += check_rollouts_steps(frames["rollouts"], frames["steps"])
    for name in ("verdicts", "verdicts_raw"):
        if name in own and "rollouts" in frames:
            problems += check_known_rollouts(frames[name], frames["rollouts"])
        if name in own and "steps" in frames:
            problems += check_citations(frames[name], frames["steps"])
    if "token_advantages" in own:
        problems += check_token_advantages(*frames["token_advantages"])
    return problems


# --- whole folders ------------------------------------------------------------------------


def _skip(path: Path) -> bool:
    return path.name.startswith(".")  # staging folders, lock and journal files


def folder_sets(root: Path) -> list[tuple[Path, list[Path]]]:
    """Each folder under ``root`` (itself included) holding tables or a manifest, with them."""
    out = []
    for folder in [root, *sorted(d for d in root.rglob("*") if d.is_dir())]:
        if any(part.startswith(".") for part in folder.relative_to(root).parts):
            continue
        files = sorted(p for p in folder.glob("*.parquet") if not _skip(p))
        if (folder / "manifest.json").is_file():
            files = _run_inputs(folder) + files + [folder / "manifest.json"]
        if files:
            out.append((folder, files))
    return out


def _run_inputs(folder: Path) -> list[Path]:
    """The rollouts and steps a run folder's manifest records, where they are now (checked
    with the run's own tables as one set); none for other folders or corrupt manifests."""
    from draco_cli.errors import DracoError
    from draco_cli.runfolder import RunFolder

    if not RunFolder.is_run_folder(folder):
        return []
    try:
        run = RunFolder.open(folder)
        assert run.manifest is not None  # open() reads it or raises
        return [p for name in ("rollouts", "steps") if name in run.manifest.inputs
                for p in [run.input(name, verify=False, missing_ok=True)] if p is not None]
    except DracoError:  # a corrupt manifest is reported by check_manifest
        return []


def _context_for(folder: Path, root: Path) -> list[Path]:
    """Tables a folder's tables are checked against: those of the folders above it (up to
    the root given), and the inputs a run manifest above it records."""
    ctx: list[Path] = []
    for up in [folder, *folder.parents]:
        if up != folder:
            ctx += sorted(p for p in up.glob("*.parquet") if not _skip(p))
        manifest = up / "manifest.json"
        from draco_cli.errors import DracoError
        from draco_cli.runfolder import RunFolder

        if manifest.is_file() and RunFolder.is_run_folder(up):
            # a run folder finds its inputs where they are now (moved with it, or absolute)
            try:
                folder_ = RunFolder.open(up)
                assert folder_.manifest is not None  # open() reads it or raises
                ctx += [p for name in ("rollouts", "steps") if name in folder_.manifest.inputs
                        for p in [folder_.input(name, verify=False, missing_ok=True)]
                        if p is not None]
            except DracoError:  # a corrupt manifest is reported by check_manifest
                pass
        elif manifest.is_file():
            inputs = _read_json(manifest)
            inputs = inputs.get("inputs") if isinstance(inputs, dict) else None
            if isinstance(inputs, dict):
                for entry in inputs.values():
                    if isinstance(entry, dict) and isinstance(entry.get("path"), str):
                        p = Path(entry["path"])
                        if p.is_file() and p.suffix == ".parquet":
                            ctx.append(p)
        if up == root or up == up.parent:
            break
    return ctx


def validate_targets(paths: Sequence[str | Path]) -> tuple[list[tuple[str, dict[str, int]]],
                                                       list[str]]:
    """``draco validate``: files given together form one set; a folder is walked, and each
    folder in it (a run folder's rubric/, judge/, credit/, ...) is checked as its own set,
    against the tables above it. Returns ((label, rows per table) per set, problems)."""
    load = _Loader()
    sets: list[tuple[str, dict[str, int]]] = []
    problems: list[str] = []
    files = [p for p in paths if str(p) == STDIO or not Path(p).is_dir()]
    if files:
        counts, found = validate_paths(files, loader=load)
        problems += found
        sets.append((", ".join(_name(f) for f in files), counts))
    for root in (Path(p) for p in paths if str(p) != STDIO and Path(p).is_dir()):
        found_sets = folder_sets(root)
        if not found_sets:
            problems.append(f"{root}: no draco tables in this folder or below it")
        for folder, members in found_sets:
            counts, found = validate_paths(members, _context_for(folder, root), loader=load)
            problems += found
            sets.append((str(folder), counts))
            journal = folder / JOURNAL_FILE
            if journal.exists():
                problems.append(f"{journal}: a publication was interrupted (killed process); "
                                "the next draco command writing this folder completes it")
    return sets, problems


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_manifest(path: Path, counts: dict[str, int], loaded: list[tuple[Path, Loaded]]
                   ) -> list[str]:
    """A manifest must parse, and what it says about its folder's tables must hold."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return [f"{path}: not UTF-8 text (a corrupt manifest)"]
    except ValueError as exc:
        return [f"{path}: not valid JSON ({exc}); a corrupt manifest"]
    if not isinstance(data, dict):
        return [f"{path}: expected a JSON object"]
    problems = []
    for table in ("rollouts", "steps"):  # an ingest manifest counts its tables
        n = data.get(table)
        if isinstance(n, int) and table in counts and counts[table] != n:
            problems.append(f"{path}: field '{table}': says {n} rows, "
                            f"{table}.parquet has {counts[table]}")
    set_id = data.get("output_set")
    if isinstance(set_id, str):
        for p, item in loaded:
            other = item.metadata.get(SET_ID_KEY.encode())
            if other is not None and other.decode() != set_id:
                problems.append(f"{path}: field 'output_set': {p.name} comes from another "
                                "write than this manifest (an interrupted or concurrent write)")
    rows = data.get("rows")
    if isinstance(rows, dict):  # a run manifest counts the stages' tables
        for rel, n in rows.items():
            table = path.parent / rel
            if isinstance(n, int) and table.is_file():
                try:
                    actual = pq.read_metadata(table).num_rows
                except (OSError, pa.ArrowInvalid):
                    continue  # the table's own check reports it
                if actual != n:
                    problems.append(f"{path}: field 'rows': says {n} rows for {rel}, "
                                    f"the file has {actual}")
    return problems


def check_output_sets(loaded: list[tuple[Path, Loaded]]) -> list[str]:
    """Tables written by one command carry one output-set id and name their fellow members;
    a member beside them with another id means a mixed (interrupted or concurrent) write."""
    problems: list[str] = []
    reported: set[frozenset[str]] = set()
    for path, item in loaded:
        set_id = item.metadata.get(SET_ID_KEY.encode())
        members = item.metadata.get(SET_MEMBERS_KEY.encode())
        if set_id is None or not members or str(path) == STDIO:
            continue
        for name in members.decode().split(","):
            sibling = path.parent / name
            if name == path.name or not sibling.is_file():
                continue
            try:
                meta = pq.read_schema(sibling).metadata or {}
            except (OSError, pa.ArrowInvalid):
                continue  # reported by the sibling's own check
            other = meta.get(SET_ID_KEY.encode())
            pair = frozenset((path.name, name))
            if other != set_id and pair not in reported:
                reported.add(pair)
                problems.append(
                    f"{path.parent}: {path.name} and {name} come from different writes "
                    f"(output sets {set_id.decode()[:8]} and "
                    f"{other.decode()[:8] if other else 'none'}): a mixed output; rerun the "
                    "command that writes them")
    return problems


def check_llm_calls(source: str, df: pl.DataFrame) -> list[str]:
    problems: list[str] = []
    rows, n = _rows(df, pl.col("status").is_null())
    _report(problems, source, "status", "must not be null", rows, n)
    return problems


def check_rollouts(source: str, df: pl.DataFrame) -> list[str]:
    problems: list[str] = []
    # One group per task per train step.
    multi = (
        df.group_by("task_id", "train_step")
        .agg(pl.col("group_id").n_unique().alias("n"), pl.col("group_id").unique().alias("g"))
        .filter(pl.col("n") > 1)
    )
    for row in multi.head(MAX_PER_RULE).iter_rows(named=True):
        problems.append(
            f"{source}: field 'group_id': task {row['task_id']!r} at train_step "
            f"{row['train_step']} is split over groups {sorted(row['g'])}"
        )
    if "policy_spans" in df.columns:
        resp = df["response_len"] if "response_len" in df.columns else None
        for rows, n, what in policy_span_issues(df["policy_spans"].to_arrow(), resp):
            _report(problems, source, "policy_spans", what, rows, n)
    return problems


def check_steps(source: str, df: pl.DataFrame) -> list[str]:
    problems: list[str] = []
    ranked = df.with_row_index("__row").with_columns(
        pl.col("step").rank("ordinal").over("rollout_id").cast(pl.Int32).alias("__rank")
    )
    # Report each broken rollout once, at its first step out of place.
    broken = ranked.filter(pl.col("step") != pl.col("__rank")).unique("rollout_id", keep="first",
                                                                      maintain_order=True)
    _report(problems, source, "step", "steps of a rollout must run 1, 2, 3, ... without gaps "
            "or repeats", broken["__row"].head(MAX_PER_RULE).to_list(), broken.height)
    return problems


def check_rollouts_steps(rollouts: tuple[str, pl.DataFrame],
                         steps: tuple[str, pl.DataFrame]) -> list[str]:
    problems: list[str] = []
    (rsrc, r), (ssrc, s) = rollouts, steps
    s = s.with_row_index("__row")
    orphan = s.join(r.select("rollout_id"), on="rollout_id", how="anti")
    if orphan.height:
        rows = orphan["__row"].head(MAX_PER_RULE).to_list()
        _report(problems, ssrc, "rollout_id", f"no such rollout in {rsrc}", rows, orphan.height)
    joined = s.join(r.select("rollout_id", "response_len", "policy_spans"), on="rollout_id")
    pos = joined.filter(pl.col("token_start").is_not_null()).with_columns(
        (pl.col("token_start") + pl.col("n_tokens")).alias("__end")
    )
    rows, n = _rows(pos, pl.col("response_len").is_not_null() & (pl.col("__end") > pl.col("response_len")))
    _report(problems, ssrc, "token_start", "step tokens end past the rollout's response_len",
            [int(pos["__row"][i]) for i in rows], n)
    ordered = pos.sort("rollout_id", "token_start").with_columns(
        pl.col("__end").shift(1).over("rollout_id").alias("__prev_end")
    )
    rows, n = _rows(ordered, pl.col("__prev_end").is_not_null()
                    & (pl.col("token_start") < pl.col("__prev_end")))
    _report(problems, ssrc, "token_start", "step token ranges overlap",
            [int(ordered["__row"][i]) for i in rows], n)
    # Steps are policy tokens: each must lie inside one of its rollout's policy spans.
    spanned = pos.filter(pl.col("policy_spans").is_not_null()).with_columns(
        pl.struct("token_start", "__end", "policy_spans").map_elements(
            lambda x: any(sp[0] <= x["token_start"] and x["__end"] <= sp[1]
                          for sp in x["policy_spans"]),
            return_dtype=pl.Boolean,
        ).alias("__inside")
    ) if pos.height and pos["policy_spans"].null_count() < pos.height else None
    if spanned is not None:
        rows, n = _rows(spanned, ~pl.col("__inside"))
        _report(problems, ssrc, "token_start", "step tokens outside the rollout's policy_spans",
                [int(spanned["__row"][i]) for i in rows], n)
    return problems


def check_known_rollouts(table: tuple[str, pl.DataFrame],
                         rollouts: tuple[str, pl.DataFrame]) -> list[str]:
    (src, df), (rsrc, r) = table, rollouts
    df = df.with_row_index("__row")
    orphan = df.join(r.select("rollout_id"), on="rollout_id", how="anti")
    problems: list[str] = []
    _report(problems, src, "rollout_id", f"no such rollout in {rsrc}",
            orphan["__row"].head(MAX_PER_RULE).to_list(), orphan.height)
    return problems


# --- checks shared with the commands that read these columns --------------------------------
# Each returns (first rows, how many, what is wrong) per broken rule: validate lists them all,
# a command raises the first (``raise_first``). One check, so validate and the commands that
# compute from these columns can never disagree about what is valid.

Issue = tuple[list[int], int, str]


def _issue(rows: np.ndarray, what: str) -> list[Issue]:
    rows = np.unique(rows)
    return [(rows[:MAX_PER_RULE].tolist(), int(rows.size), what)] if rows.size else []


def _combined(arr: pa.Array[Any] | pa.ChunkedArray[Any]) -> pa.Array[Any]:
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


@dataclass
class FlatSpans:
    """policy_spans flattened: rollout i's spans are ``start[offsets[i]:offsets[i + 1]]`` /
    ``end[...]``; ``start`` and ``end`` are views of the file's integer buffer (no copy)."""

    offsets: np.ndarray  # int64, one more than rollouts
    start: np.ndarray
    end: np.ndarray

    def rollout_of(self, span: np.ndarray) -> np.ndarray:
        """The rollout (row) of each span index."""
        found: np.ndarray = np.searchsorted(self.offsets, span, side="right") - 1
        return found


def _is_span_lists(t: Any) -> bool:  # a pa.DataType; list types carry value_type
    return bool(_is_list(t) and _is_list(t.value_type)
                and pa.types.is_integer(t.value_type.value_type))


def flat_policy_spans(spans: pa.Array[Any] | pa.ChunkedArray[Any]) -> FlatSpans | None:
    """policy_spans as ``FlatSpans`` when every span is a pair of non-null bounds (a null
    rollout holding none); None for anything else, which ``policy_span_issues`` reports."""
    if not _is_span_lists(spans.type):
        return None
    lists = cast("pa.ListArray[Any]", _combined(spans))  # or LargeListArray: the same accessors
    outer = lists.offsets.to_numpy().astype(np.int64)  # into lists.values (slice-aware)
    if lists.null_count and np.any(np.diff(outer)[~lists.is_valid().to_numpy(
            zero_copy_only=False)]):
        return None  # a null rollout backed by spans: let the general path decide
    first, last = int(outer[0]), int(outer[-1])
    inner = cast("pa.ListArray[Any]", lists.values.slice(first, last - first))
    if inner.null_count:
        return None
    inner_off = inner.offsets.to_numpy()
    if np.any(np.diff(inner_off) != 2):
        return None
    bounds = inner.values.slice(int(inner_off[0]), int(inner_off[-1] - inner_off[0]))
    if bounds.null_count:
        return None
    pairs = bounds.to_numpy()
    return FlatSpans(outer - first, pairs[0::2], pairs[1::2])


def policy_span_issues(spans: pa.Array[Any] | pa.ChunkedArray[Any],
                       response_len: pl.Series | None = None,
                       flat: FlatSpans | None = None) -> list[Issue]:
    """policy_spans: list<list<int>> of half-open [start, end) pairs, start >= 0, end > start,
    sorted and non-overlapping within a rollout, ending at or before response_len.

    ``flat`` is ``flat_policy_spans(spans)`` when the caller has it already."""
    t = spans.type
    if not _is_span_lists(t):
        return [([], 1, f"expected list<list<int32>>, got {t}")]
    flat = flat if flat is not None else flat_policy_spans(spans)
    if flat is None:  # a malformed span or a null somewhere: the general path names it
        return _policy_span_issues_general(spans, response_len)
    # Well-formed pairs: checked on the file's own buffers, a rollout's spans found by its
    # offsets instead of a per-span rollout index.
    start, end, offsets = flat.start, flat.end, flat.offsets
    issues = _issue(flat.rollout_of(np.flatnonzero((start < 0) | (end <= start))),
                    "span with start < 0 or end <= start")
    if response_len is not None and start.size:
        resp = response_len.fill_null(-1).to_numpy().astype(np.int64)
        nonempty = np.flatnonzero(np.diff(offsets) > 0)
        last_end = np.maximum.reduceat(end, offsets[nonempty])
        rows = nonempty[(resp[nonempty] >= 0) & (last_end > resp[nonempty])]
        issues += _issue(rows, "span ends past response_len")
    if start.size > 1:
        out_of_order = start[1:] < end[:-1]
        heads = offsets[(offsets > 0) & (offsets < start.size)]  # first span of a rollout
        out_of_order[heads - 1] = False
        issues += _issue(flat.rollout_of(np.flatnonzero(out_of_order) + 1),
                         "spans overlap or are out of order")
    return issues


def _policy_span_issues_general(spans: pa.Array[Any] | pa.ChunkedArray[Any],
                                response_len: pl.Series | None = None) -> list[Issue]:
    """policy_span_issues for any list<list<int>> column, nulls and odd shapes included."""
    spans = _combined(spans)
    parent = pc.list_parent_indices(spans).to_numpy().astype(np.int64)
    inner = pc.list_flatten(spans)
    lens = pc.list_value_length(inner).fill_null(0).to_numpy(zero_copy_only=False)
    shape = _issue(parent[lens != 2], "a span must be a [start, end) pair")
    if shape:
        return shape
    pairs = pc.list_flatten(inner)
    if pairs.null_count:
        null = pc.is_null(pairs).to_numpy(zero_copy_only=False).reshape(-1, 2).any(axis=1)
        return _issue(parent[null], "a span bound is null")
    bounds = pairs.to_numpy(zero_copy_only=False).astype(np.int64)
    start, end = bounds[0::2], bounds[1::2]
    issues = _issue(parent[(start < 0) | (end <= start)], "span with start < 0 or end <= start")
    if response_len is not None:
        resp = response_len.fill_null(-1).to_numpy().astype(np.int64)[parent]
        issues += _issue(parent[(resp >= 0) & (end > resp)], "span ends past response_len")
    same = parent[1:] == parent[:-1]
    issues += _issue(parent[1:][same & (start[1:] < end[:-1])],
                     "spans overlap or are out of order")
    return issues


def token_advantage_issues(df: pl.DataFrame) -> list[tuple[str, Issue]]:
    """token_advantages: span lists of equal length, each span inside 0..length, non-empty,
    sorted and non-overlapping; a dense list of exactly ``length`` values."""
    out: list[tuple[str, Issue]] = []
    length = df["length"].to_numpy().astype(np.int64)
    if "advantages" in df.columns:
        n = df["advantages"].list.len()
        bad = np.flatnonzero((n.is_not_null() & (n != df["length"])).to_numpy())
        out += [("advantages", i) for i in _issue(bad, "holds a different number of values "
                                                   "than length")]
    if all(c in df.columns for c in ("span_start", "span_end", "span_value")):
        ns = [df[c].list.len().fill_null(0).to_numpy() for c in
              ("span_start", "span_end", "span_value")]
        bad = np.flatnonzero((ns[0] != ns[1]) | (ns[0] != ns[2]))
        issue = _issue(bad, "span_start, span_end and span_value differ in length")
        if issue:
            return out + [("span_start", i) for i in issue]
        row = np.repeat(np.arange(df.height, dtype=np.int64), ns[0])
        start, end = (_combined(pc.list_flatten(_combined(df[c].to_arrow())))
                      .to_numpy(zero_copy_only=False).astype(np.int64)
                      for c in ("span_start", "span_end"))
        out += [("span_start", i) for i in _issue(
            row[(start < 0) | (end <= start) | (end > length[row])],
            "span outside 0..length, or empty")]
        same = row[1:] == row[:-1]
        out += [("span_start", i) for i in _issue(
            row[1:][same & (start[1:] < end[:-1])], "token spans overlap or are out of order")]
    return out


def raise_first(issues: list[Issue], source: str, field: str) -> None:
    """Raise the first issue as an InputError (how commands use the shared checks)."""
    if issues:
        rows, n, what = issues[0]
        more = f" ({n} rows)" if n > 1 else ""
        raise InputError(what + more, file=source, row=rows[0] if rows else None, field=field)


def check_token_advantages(source: str, df: pl.DataFrame) -> list[str]:
    problems: list[str] = []
    for field, (rows, n, what) in token_advantage_issues(df):
        _report(problems, source, field, what, rows, n)
    return problems


def check_citations(table: tuple[str, pl.DataFrame],
                    steps: tuple[str, pl.DataFrame]) -> list[str]:
    """Every cited step exists: 1 <= step <= the rollout's last step."""
    (src, df), (ssrc, s) = table, steps
    last = s.group_by("rollout_id").agg(pl.col("step").max().alias("__M"))
    cited = (df.select("rollout_id", "cited_steps").with_row_index("__row")
             .explode("cited_steps").filter(pl.col("cited_steps").is_not_null())
             .join(last, on="rollout_id", how="left").with_columns(pl.col("__M").fill_null(0)))
    bad = cited.filter((pl.col("cited_steps") < 1) | (pl.col("cited_steps") > pl.col("__M")))
    problems: list[str] = []
    if bad.height:
        first = bad.row(0, named=True)
        rows = sorted(set(bad["__row"].to_list()))
        _report(problems, src, "cited_steps",
                f"cites steps that do not exist in {ssrc} (e.g. step {first['cited_steps']} of "
                f"rollout {first['rollout_id']!r}, which has {first['__M']})",
                rows[:MAX_PER_RULE], len(rows))
    return problems
