"""A run folder written by ``draco run``: its typed, versioned manifest, where its tables live,
where its inputs are (found even after the folder moved with them), and the lock that keeps two
writers apart. See docs/run.md, "The run folder and its manifest".
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from draco_cli.errors import DracoError, InputError
from draco_cli.io.files import file_sha256

MANIFEST = "manifest.json"
LOCK = ".draco.lock"
# 1: draco ≤ 0.x wrote {"path": <as typed>, "sha256"} inputs and no version field.
# 2: absolute + relative input paths, "manifest_version", per-stage status as stages finish,
#    "health".
MANIFEST_VERSION = 2

TABLES = {
    "rubric_candidates": "rubric/rubric_candidates.parquet",
    "rubrics": "rubric/rubrics.parquet",
    "verdicts_raw": "judge/verdicts_raw.parquet",
    "verdicts": "judge/verdicts.parquet",
    "rewards": "credit/rewards.parquet",
    "step_credit": "credit/step_credit.parquet",
    "token_advantages": "credit/token_advantages.parquet",
    "rubric_dropout": "credit/rubric_dropout.parquet",
    "spot_checks": "judge/spot_checks.parquet",
    "agreement": "audit/agreement.parquet",
}


class InputRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    path: str                        # absolute when written by manifest version ≥ 2
    relative: str | None = None   # relative to the run folder
    sha256: str
    bytes: int | None = None


class StageRecord(BaseModel):
    """One stage as the manifest records it; a stage may add its own fields (stats, kind…)."""

    model_config = ConfigDict(extra="allow")

    key: str
    status: str                      # running | done | partial | budget reached | interrupted
    seconds: float | None = None
    notes: list[str] = Field(default_factory=list)
    rows: int | None = None       # rows of the stage's main table
    kind: str | None = None       # rubric: dynamic | static
    criteria: int | None = None   # static rubric: criteria × groups
    calls: dict[str, Any] | None = None   # LLM stages: calls new / reused, dollars
    health: dict[str, Any] | None = None  # LLM stages: what the health check reads
    stats: dict[str, Any] | None = None   # credit: CreditStats
    reward: str | None = None     # credit: rubric | outcome


class StageHealth(BaseModel):
    """A stage's answered figure (``draco_cli.llm.answered``): requests the stage needed, one
    per sample of each prompt, reused answers included, and how many have an answer."""

    requests: int
    answered: int
    answered_share: float
    reasons: dict[str, int] = Field(default_factory=dict)
    ok: bool

    @model_validator(mode="before")
    @classmethod
    def _older(cls, data: Any) -> Any:
        # manifests before the figure was named called the same requests "calls"
        if isinstance(data, dict) and "requests" not in data and "calls" in data:
            data = {**data, "requests": data["calls"]}
            del data["calls"]
        return data


class Health(BaseModel):
    ok: bool
    threshold: float
    stages: dict[str, StageHealth] = Field(default_factory=dict)
    messages: list[str] = Field(default_factory=list)
    # the signal check (credit): share of rollouts with a non-zero advantage, and its verdict
    signal: dict[str, Any] | None = None


class Manifest(BaseModel):
    # extra="allow": a newer draco's additions survive an older reader rewriting nothing
    model_config = ConfigDict(extra="allow")

    manifest_version: int = MANIFEST_VERSION
    draco_version: str = ""
    status: str = "running"
    train_step: int | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    prompt_versions: dict[str, str] = Field(default_factory=dict)
    inputs: dict[str, InputRecord] = Field(default_factory=dict)
    stages: dict[str, StageRecord] = Field(default_factory=dict)
    skipped_this_run: list[str] = Field(default_factory=list)
    rows: dict[str, int] = Field(default_factory=dict)
    llm_calls: dict[str, dict[str, Any]] = Field(default_factory=dict)
    wall_seconds: float | None = None
    updated_at: str | None = None
    token_advantages: str | None = None
    health: Health | None = None


def input_record(path: Path, run_dir: Path) -> InputRecord:
    """What the manifest keeps of one input: where it is (absolute, and relative to the run
    folder) and what it holds."""
    absolute = Path(os.path.abspath(path))
    return InputRecord(path=str(absolute),
                       relative=os.path.relpath(absolute, os.path.abspath(run_dir)),
                       sha256=file_sha256(absolute), bytes=absolute.stat().st_size)


class RunFolder:
    """A run folder: ``RunFolder.open(path)`` to read one, ``RunFolder(path)`` to write one."""

    def __init__(self, path: str | os.PathLike[str], manifest: Manifest | None = None) -> None:
        self.path = Path(path)
        self.manifest = manifest

    # -- reading ---------------------------------------------------------------------------

    @staticmethod
    def is_run_folder(path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` holds a draco run's manifest (``draco ingest`` writes a
        manifest.json too, without stages). An unreadable manifest counts, so that opening
        the folder reports it."""
        p = Path(path) / MANIFEST
        if not p.is_file():
            return False
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return True
        return not isinstance(data, dict) or "stages" in data

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunFolder:
        """Open a run folder written by ``draco run``; a missing, unreadable or corrupt
        manifest is a one-line InputError saying what to do."""
        folder = cls(path)
        if not Path(path).is_dir():
            raise InputError("no such run folder", file=str(path))
        manifest = folder.read_manifest()
        if manifest is None:
            raise InputError("not a draco run folder (no manifest.json); write one with "
                             "draco run -o", file=str(path))
        folder.manifest = manifest
        return folder

    def read_manifest(self) -> Manifest | None:
        """The manifest, or None when there is none yet."""
        p = self.path / MANIFEST
        if not p.exists():
            return None
        fix = ("delete it and rerun the draco run that made this folder: every stage is redone "
               "from the call log, nothing is paid twice")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise InputError(f"corrupt manifest ({why}); {fix}", file=str(p)) from None
        if not isinstance(data, dict):
            raise InputError(f"corrupt manifest (not a JSON object); {fix}", file=str(p))
        version = data.get("manifest_version", 1)
        if not isinstance(version, int) or version > MANIFEST_VERSION:
            raise InputError(f"manifest version {version!r} is newer than this draco reads "
                             f"({MANIFEST_VERSION}); upgrade draco", file=str(p))
        try:
            return Manifest.model_validate({**data, "manifest_version": version})
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise InputError(f"corrupt manifest ({where}: {err['msg']}); {fix}",
                             file=str(p)) from None

    @property
    def rollouts(self) -> Path:
        path = self.input("rollouts")
        assert path is not None
        return path

    @property
    def train_step(self) -> int | None:
        return self.manifest.train_step if self.manifest else None

    def table(self, name: str) -> Path:
        """Where a table of this run lives (it may not exist: the run may not have made it)."""
        return self.path / TABLES[name]

    def has(self, name: str) -> bool:
        return self.table(name).is_file()

    @property
    def call_log(self) -> Path:
        own = self.path / "llm_calls.sqlite"
        log = self.manifest.settings.get("call_log") if self.manifest else None
        # a moved folder carries its own log; a --call-log elsewhere stays where it was
        return Path(log) if log and Path(log).exists() and not own.exists() else own

    def input(self, name: str, verify: bool = True, missing_ok: bool = False) -> Path | None:
        """Where input ``name`` (rollouts, steps) is now: its absolute path, else the same
        path relative to the run folder (the folder moved with its inputs), else (old
        manifests) the path as written. With ``verify``, a file whose content changed since
        the run is refused, never read as if it were the same."""
        assert self.manifest is not None
        rec = self.manifest.inputs.get(name)
        if rec is None:
            raise InputError(f"the run records no {name} input", file=str(self.path / MANIFEST))
        candidates = [Path(rec.path)] if Path(rec.path).is_absolute() else \
            [self.path / rec.path, Path(rec.path)]
        if rec.relative is not None:
            candidates.insert(1, self.path / rec.relative)
        found = [p for p in candidates if p.is_file()]
        if not found and missing_ok:
            return None
        if not found:
            raise InputError(f"the run's {name} input is gone (looked at "
                             f"{', '.join(str(p) for p in candidates)})",
                             file=str(self.path / MANIFEST), field=f"inputs.{name}")
        if not verify:
            return found[0]
        for p in found:
            if (rec.bytes is None or p.stat().st_size == rec.bytes) and \
                    file_sha256(p) == rec.sha256:
                return p
        raise InputError(f"the run's {name} input changed since the run (SHA-256 differs): "
                         "rerun draco run on it", file=str(found[0]))

    # -- writing ---------------------------------------------------------------------------

    def write_manifest(self, manifest: Manifest) -> None:
        from draco_cli.io import write_text_atomic

        self.manifest = manifest
        write_text_atomic(self.path / MANIFEST,
                          manifest.model_dump_json(indent=2, exclude_none=False) + "\n",
                          force=True)

    @contextlib.contextmanager
    def lock(self, wait: bool = True, on_wait: Callable[[str], None] | None = None
             ) -> Iterator[None]:
        """Hold the folder's write lock. Another holder makes this wait (``on_wait`` is told
        once who holds it) or, with ``wait=False``, raise RunFolderBusy. The lock is the
        kernel's (flock): a killed holder releases it, so it is never stale."""
        import fcntl

        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InputError(f"cannot write the run folder ({exc.strerror or exc})",
                             file=str(self.path)) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                if not wait:
                    raise RunFolderBusy(self.path, holder) from None
                if on_wait is not None:
                    on_wait(holder)
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock


class RunFolderBusy(DracoError):
    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path}: another draco run (pid {holder}) is writing this run "
                         "folder; wait for it to finish (drop --no-wait to wait for it), or "
                         "write elsewhere with -o")
