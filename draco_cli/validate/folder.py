"""Validation of files and run folders: each table against its contract, manifests, output sets and the tables against each other."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence, Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from draco_cli.errors import InputError
from draco_cli.io import (
    JOURNAL_FILE,
    SET_ID_KEY,
    SET_MEMBERS_KEY,
    STDIO,
    as_frame,
    conform,
    read_arrow,
    read_stdin_table,
)
from draco_cli.schemas import Table
from draco_cli.publish import source_name
from draco_cli.validate.issues import MAX_PER_RULE, _report, _rows, detect_table
from draco_cli.validate.tokens import check_token_advantages, policy_span_issues

LLM_CALLS = "llm_calls.parquet"  # draco's export of a call log (draco_cli.llm.calllog)


LLM_CALLS_COLUMNS = ("request_hash", "phase", "status")


@dataclass
class Loaded:
    source: str
    model: type[Table] | None  # None: the call-log export
    df: pl.DataFrame
    metadata: dict[bytes, bytes]


def _load(path: str, stdin_table: str | None = None) -> Loaded | str:
    """The checked table, or the problem that stopped reading it (cached per set of sets
    with ``functools.cache``: a file is read once, however many sets it is context for)."""
    try:
        arrow = read_stdin_table(stdin_table) if str(path) == STDIO else read_arrow(path)
        meta = dict(arrow.schema.metadata or {})
        if Path(path).name == LLM_CALLS and b"draco.table" not in meta:
            df = as_frame(arrow)
            missing = [c for c in LLM_CALLS_COLUMNS if c not in df.columns]
            if missing:
                return f"{path}: field '{missing[0]}': missing column of a draco call log"
            return Loaded(source_name(path), None, df, meta)
        model = detect_table(path, meta)
        if model is None:
            return (f"{path}: cannot tell which table this is (name it after the table, "
                    f"e.g. rollouts.parquet, or write it with draco)")
        df = conform(as_frame(arrow), model, source_name(path))
    except InputError as exc:
        return str(exc)
    return Loaded(source_name(path), model, df, meta)


def validate_paths(paths: Sequence[str | Path], context: Sequence[str | Path] = (),
                   loader: Callable[[str], Loaded | str] | None = None
                   ) -> tuple[dict[str, int], list[str]]:
    """Validate files as one set; return (rows per table, problems). Tables are matched to
    their contract by metadata or file name (rollouts.parquet, steps.parquet, ...).

    ``context`` tables (e.g. a run's rollouts and steps, for its verdicts) take part in the
    checks across tables but are not themselves checked or counted here."""
    load = loader or functools.cache(_load)
    frames: dict[str, tuple[str, pl.DataFrame]] = {}
    problems: list[str] = []
    counts: dict[str, int] = {}
    loaded: list[tuple[Path, Loaded]] = []
    manifests: list[Path] = []
    for path in paths:
        if Path(path).name == "manifest.json":
            manifests.append(Path(path))
            continue
        item = load(str(path))
        if isinstance(item, str):
            problems.append(item)
            continue
        name = "llm_calls" if item.model is None else item.model.table_name
        if name in frames:
            problems.append(f"{path}: a second '{name}' table (first: "
                            f"{frames[name][0]}); validate one set at a time")
            continue
        frames[name] = (item.source, item.df)
        counts[name] = item.df.height
        loaded.append((Path(path), item))
    for path in context:
        item = load(str(path))
        if not isinstance(item, str) and item.model is not None \
                and item.model.table_name not in frames:
            frames[item.model.table_name] = (item.source, item.df)
    problems += _table_checks(frames, counts.keys())
    problems += check_output_sets(loaded)
    for m in manifests:
        problems += check_manifest(m, counts, loaded)
    return counts, problems


def _table_checks(frames: dict[str, tuple[str, pl.DataFrame]], own: AbstractSet[str]
                  ) -> list[str]:
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
    from draco_cli.run.folder import RunFolder

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
    the root given), and the inputs a run manifest above it records (where they are now: moved
    with the folder, or absolute)."""
    ctx: list[Path] = []
    for up in [folder, *folder.parents]:
        if up != folder:
            ctx += sorted(p for p in up.glob("*.parquet") if not _skip(p))
        ctx += _run_inputs(up)
        if up == root or up == up.parent:
            break
    return ctx


def validate_targets(paths: Sequence[str | Path], stdin_table: str | None = None
                     ) -> tuple[list[tuple[str, dict[str, int]]], list[str]]:
    """``draco validate``: files given together form one set; a folder is walked, and each
    folder in it (a run folder's rubric/, judge/, credit/, ...) is checked as its own set,
    against the tables above it. ``stdin_table`` names the table ``-`` holds. Returns
    ((label, rows per table) per set, problems)."""
    load = functools.cache(functools.partial(_load, stdin_table=stdin_table))
    sets: list[tuple[str, dict[str, int]]] = []
    problems: list[str] = []
    files = [p for p in paths if str(p) == STDIO or not Path(p).is_dir()]
    if files:
        counts, found = validate_paths(files, loader=load)
        problems += found
        sets.append((", ".join(source_name(f) for f in files), counts))
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
    return _report(source, "status", "must not be null", *_rows(df, pl.col("status").is_null()))


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
            problems += _report(source, "policy_spans", what, rows, n)
    return problems


def check_steps(source: str, df: pl.DataFrame) -> list[str]:
    ranked = df.with_row_index("__row").with_columns(
        pl.col("step").rank("ordinal").over("rollout_id").cast(pl.Int32).alias("__rank")
    )
    # Report each broken rollout once, at its first step out of place.
    broken = ranked.filter(pl.col("step") != pl.col("__rank")).unique("rollout_id", keep="first",
                                                                      maintain_order=True)
    return _report(source, "step", "steps of a rollout must run 1, 2, 3, ... without gaps "
                   "or repeats", broken["__row"].head(MAX_PER_RULE).to_list(), broken.height)


def check_rollouts_steps(rollouts: tuple[str, pl.DataFrame],
                         steps: tuple[str, pl.DataFrame]) -> list[str]:
    problems = check_known_rollouts(steps, rollouts)
    (_, r), (ssrc, s) = rollouts, steps
    s = s.with_row_index("__row")
    joined = s.join(r.select("rollout_id", "response_len", "policy_spans"), on="rollout_id")
    pos = joined.filter(pl.col("token_start").is_not_null()).with_columns(
        (pl.col("token_start") + pl.col("n_tokens")).alias("__end")
    )
    rows, n = _rows(pos, pl.col("response_len").is_not_null() & (pl.col("__end") > pl.col("response_len")))
    problems += _report(ssrc, "token_start", "step tokens end past the rollout's response_len",
                        [int(pos["__row"][i]) for i in rows], n)
    ordered = pos.sort("rollout_id", "token_start").with_columns(
        pl.col("__end").shift(1).over("rollout_id").alias("__prev_end")
    )
    rows, n = _rows(ordered, pl.col("__prev_end").is_not_null()
                    & (pl.col("token_start") < pl.col("__prev_end")))
    problems += _report(ssrc, "token_start", "step token ranges overlap",
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
        problems += _report(ssrc, "token_start", "step tokens outside the rollout's "
                            "policy_spans", [int(spanned["__row"][i]) for i in rows], n)
    return problems


def check_known_rollouts(table: tuple[str, pl.DataFrame],
                         rollouts: tuple[str, pl.DataFrame]) -> list[str]:
    (src, df), (rsrc, r) = table, rollouts
    df = df.with_row_index("__row")
    orphan = df.join(r.select("rollout_id"), on="rollout_id", how="anti")
    return _report(src, "rollout_id", f"no such rollout in {rsrc}",
                   orphan["__row"].head(MAX_PER_RULE).to_list(), orphan.height)


def check_citations(table: tuple[str, pl.DataFrame],
                    steps: tuple[str, pl.DataFrame]) -> list[str]:
    """Every cited step exists: 1 <= step <= the rollout's last step."""
    (src, df), (ssrc, s) = table, steps
    last = s.group_by("rollout_id").agg(pl.col("step").max().alias("__M"))
    cited = (df.select("rollout_id", "cited_steps").with_row_index("__row")
             .explode("cited_steps").filter(pl.col("cited_steps").is_not_null())
             .join(last, on="rollout_id", how="left").with_columns(pl.col("__M").fill_null(0)))
    bad = cited.filter((pl.col("cited_steps") < 1) | (pl.col("cited_steps") > pl.col("__M")))
    if not bad.height:
        return []
    first = bad.row(0, named=True)
    rows = sorted(set(bad["__row"].to_list()))
    return _report(src, "cited_steps",
                   f"cites steps that do not exist in {ssrc} (e.g. step {first['cited_steps']} of "
                   f"rollout {first['rollout_id']!r}, which has {first['__M']})",
                   rows[:MAX_PER_RULE], len(rows))
