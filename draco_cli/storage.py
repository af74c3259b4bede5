"""Inputs and outputs on object storage (``s3://``, ``gs://``, ``hdfs://``, ``abfs://``),
staged at the edge through pyarrow's file systems (``pyarrow.fs.FileSystem.from_uri``): inputs
into a local cache, outputs into a staging copy uploaded only on success. See docs/storage.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from draco_cli.errors import DracoError

REMOTE = re.compile(r"^(s3|gs|gcs|hdfs|viewfs|abfs|abfss)://", re.IGNORECASE)
# never uploaded: locks, SQLite's side files, half-written temporaries
_SCRATCH = re.compile(r"(\.lock|-wal|-shm|-journal|\.tmp)$|^\.draco-staging-")
_CHUNK = 8 << 20
GCS_RETRY_SECONDS = 30


class StorageError(DracoError):
    """A remote path that cannot be read or written: missing bucket, credentials, endpoint."""


def cache_root() -> Path:
    root = os.environ.get("DRACO_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draco"


def _bucket(uri: str) -> str | None:
    scheme, _, rest = uri.partition("://")
    return rest.split("/", 1)[0] if scheme.lower() in ("s3", "gs", "gcs") else None


def _check_credentials(uri: str) -> None:
    """S3 without any credential source, where the SDK cannot find one on its own (instance
    metadata disabled): say so, instead of an anonymous request's puzzling refusal."""
    if not uri.lower().startswith("s3://"):
        return
    env = os.environ
    if env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        return   # an instance role may answer; the SDK's own chain decides
    sources = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
               "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
    if any(env.get(s) for s in sources):
        return
    files = [env.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials",
             env.get("AWS_CONFIG_FILE") or Path.home() / ".aws" / "config"]
    if any(Path(f).is_file() for f in files):
        return
    raise StorageError(f"{uri}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")


def describe(exc: BaseException, uri: str) -> str:
    """One line for a failed remote operation, naming the URI and what to fix."""
    text = " ".join(str(exc).split())
    bucket = _bucket(uri)
    if "NO_SUCH_BUCKET" in text or "bucket does not exist" in text.lower():
        return f"{uri}: no such bucket '{bucket}'"
    if re.search(r"NETWORK_CONNECTION|curlCode|Could not connect|Couldn't resolve|"
                 r"Connection refused|timed out", text, re.IGNORECASE):
        where = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return (f"{uri}: cannot reach the storage endpoint"
                + (f" {where} (AWS_ENDPOINT_URL)" if where else ""))
    scheme = uri.partition("://")[0].lower()
    if scheme in ("gs", "gcs") and re.search(r"OAuth2 access token|UNAUTHENTICATED|"
                                               r"PERMISSION_DENIED", text):
        return (f"{uri}: no usable Google Cloud credentials (set "
                "GOOGLE_APPLICATION_CREDENTIALS, or run gcloud auth application-default login)")
    if scheme.startswith("abfs") and "Authentication" in text:
        return (f"{uri}: no usable Azure credentials (set AZURE_STORAGE_ACCOUNT_KEY, or log in "
                "with the Azure CLI)")
    if re.search(r"ACCESS_DENIED|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|"
                 r"HTTP status 40[13]|Forbidden|credentials", text, re.IGNORECASE):
        return (f"{uri}: access denied (check the credentials: AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")
    return f"{uri}: {text[:300]}"


@contextmanager
def _remote(uri: str) -> Iterator[None]:
    """Map pyarrow's errors for ``uri`` to one-line StorageErrors."""
    from pyarrow import ArrowException

    try:
        yield
    except DracoError:
        raise
    except (OSError, ValueError, ArrowException) as exc:   # ArrowException: what pyarrow's
        # cloud SDKs raise beside its own errors (Azure's AuthenticationException)
        raise StorageError(describe(exc, uri)) from None


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow FileSystem, path inside it) for ``uri``."""
    import pyarrow.fs as pafs

    _check_credentials(uri)
    if uri.lower().startswith(("gs://", "gcs://")) and "?" not in uri:
        # Google's client retries for 15 minutes by default, silently, when no credential
        # answers (no key, no metadata server): an operation gives up after 30 s instead
        uri_options = f"{uri}?retry_limit_seconds={GCS_RETRY_SECONDS}"
    else:
        uri_options = uri
    with _remote(uri):
        fs, path = pafs.FileSystem.from_uri(uri_options)
    return fs, path.rstrip("/")


def _info(fs: Any, path: str, uri: str) -> Any:
    with _remote(uri):
        return fs.get_file_info(path)


def _require_bucket(fs: Any, uri: str) -> None:
    import pyarrow.fs as pafs

    bucket = _bucket(uri)
    if bucket and _info(fs, bucket, uri).type == pafs.FileType.NotFound:
        raise StorageError(f"{uri}: no such bucket '{bucket}'")


def _listing(fs: Any, path: str, uri: str) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under the folder ``path``."""
    import pyarrow.fs as pafs

    with _remote(uri):
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return {i.path[len(path):].lstrip("/"): (i.size, i.mtime_ns or 0) for i in infos
            if i.type == pafs.FileType.File}


def _download(fs: Any, src: str, dest: Path, uri: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with _remote(uri), fs.open_input_stream(src) as f, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(f, out, _CHUNK)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _upload(src: Path, fs: Any, dest: str, uri: str) -> None:
    with _remote(uri):
        if _bucket(uri) is None and "/" in dest:   # HDFS, Azure: folders exist; buckets: not
            fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        with open(src, "rb") as f, fs.open_output_stream(dest) as out:
            shutil.copyfileobj(f, out, _CHUNK)


def fetch(uri: str) -> Path:
    """A local copy of the remote file or folder ``uri`` (downloaded once per version)."""
    import pyarrow.fs as pafs

    from draco_cli.errors import InputError

    fs, path = filesystem(uri)
    info = _info(fs, path, uri)
    name = Path(path).name or "root"
    if info.type == pafs.FileType.NotFound:
        _require_bucket(fs, uri)
        raise InputError("no such file", file=uri)
    if info.type == pafs.FileType.Directory:
        files = _listing(fs, path, uri)
        key = hashlib.sha256(json.dumps([uri, sorted(files.items())]).encode()).hexdigest()
        dest = cache_root() / "inputs" / key[:32] / name
        if not (dest.parent / ".complete").exists():
            for rel in files:
                _download(fs, f"{path}/{rel}", dest / rel, uri)
            dest.mkdir(parents=True, exist_ok=True)
            (dest.parent / ".complete").touch()
        return dest
    key = hashlib.sha256(f"{uri}\0{info.size}\0{info.mtime_ns}".encode()).hexdigest()
    dest = cache_root() / "inputs" / key[:32] / name
    if not dest.exists():
        _download(fs, path, dest, uri)
    return dest


@dataclass
class StagedOutput:
    """A remote output (file or folder) written locally first and published on success."""

    uri: str
    local: Path
    fs: Any
    path: str
    # relative path -> [remote size, remote mtime_ns, local size, local mtime_ns] as last
    # synchronised: what changed locally since then is what to upload
    state: dict[str, list[int]] = field(default_factory=dict)
    is_file: bool = False

    @property
    def _state_file(self) -> Path:
        return self.local.parent / "remote-state.json"

    def _files(self) -> dict[str, Path]:
        if self.is_file:
            return {"": self.local} if self.local.is_file() else {}
        return {p.relative_to(self.local).as_posix(): p for p in self.local.rglob("*")
                if p.is_file() and not any(_SCRATCH.search(part) for part in
                                           p.relative_to(self.local).parts)}

    def _remote_path(self, rel: str) -> str:
        return f"{self.path}/{rel}" if rel else self.path

    def pull(self) -> None:
        """Bring the remote's current objects into the staging copy, keeping local changes
        to objects the remote has not changed since they were last synchronised."""
        import pyarrow.fs as pafs

        _require_bucket(self.fs, self.uri)
        old = json.loads(self._state_file.read_text()) if self._state_file.exists() else {}
        info = _info(self.fs, self.path, self.uri)
        if info.type == pafs.FileType.File:
            remote = {"": (info.size, info.mtime_ns or 0)}
        elif info.type == pafs.FileType.Directory:
            remote = _listing(self.fs, self.path, self.uri)
        else:
            remote = {}
        if self.is_file and "" not in remote and remote:
            raise StorageError(f"{self.uri}: is a folder, not a file")
        for rel, (size, mtime) in remote.items():
            if _SCRATCH.search(rel.rsplit("/", 1)[-1]):
                continue
            dest = self.local / rel if rel else self.local
            if old.get(rel, [None, None])[:2] == [size, mtime] and dest.exists():
                self.state[rel] = old[rel]
                continue   # unchanged remotely: the local copy (perhaps resumed work) stays
            _download(self.fs, self._remote_path(rel), dest, self.uri)
            st = dest.stat()
            self.state[rel] = [size, mtime, st.st_size, st.st_mtime_ns]
        self._save()

    def _save(self) -> None:
        self._state_file.parent.mkdir(parents=True, exist_ok=True)
        self._state_file.write_text(json.dumps(self.state))

    def publish(self) -> int:
        """Upload the files that are new or changed since the pull (manifest.json last);
        return how many were uploaded."""
        changed = []
        for rel, p in self._files().items():
            st = p.stat()
            if self.state.get(rel, [None] * 4)[2:] != [st.st_size, st.st_mtime_ns]:
                changed.append(rel)
        changed.sort(key=lambda rel: (rel.endswith("manifest.json"), rel))
        for rel in changed:
            self._upload_one(rel)
        self._save()
        return len(changed)

    def _upload_one(self, rel: str) -> None:
        src = self.local / rel if rel else self.local
        _upload(src, self.fs, self._remote_path(rel), self.uri)
        info = _info(self.fs, self._remote_path(rel), self.uri)
        st = src.stat()
        self.state[rel] = [info.size, info.mtime_ns or 0, st.st_size, st.st_mtime_ns]


def stage_output(uri: str, is_file: bool | None = None) -> StagedOutput:
    """The local staging copy of the output ``uri``, holding what the remote holds now.
    ``is_file``: None guesses from the name (an extension means a file)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    name = Path(path).name or "root"
    if is_file is None:   # what the remote holds decides; a new name with an extension is a file
        kind = _info(fs, path, uri).type
        is_file = kind == pafs.FileType.File or (kind == pafs.FileType.NotFound and "." in name)
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:32]
    out = StagedOutput(uri, cache_root() / "outputs" / key / name, fs, path, is_file=is_file)
    if not is_file:
        out.local.mkdir(parents=True, exist_ok=True)
    out.pull()
    return out


# -- the command line's edge: each path option declares its kind (draco_cli.cli.options) ----

Kind = Literal["input", "output", "log"]   # output: a file or folder by its name; log: a file


@dataclass
class Staging:
    """One invocation's staged remote paths: its outputs, published if the command succeeds."""

    outputs: list[StagedOutput] = field(default_factory=list)
    local_to_uri: dict[str, str] = field(default_factory=dict)

    def publish(self) -> None:
        for out in self.outputs:
            out.publish()

    def name_remote(self, message: str) -> str:
        """``message`` with staged local paths shown as the URIs the user gave."""
        for local, uri in sorted(self.local_to_uri.items(), key=lambda kv: -len(kv[0])):
            message = message.replace(local, uri)
        return message


current: ContextVar[Staging] = ContextVar("draco_staging")


def stage(value: str, kind: Kind = "input") -> str:
    """``value`` itself if local, else its staged local path: an input fetched, an output or a
    call ``log`` (read to resume, then written) pulled and registered for publishing. A
    ``file://`` URI is its local path."""
    if value[:7].lower() == "file://":
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(value).path)
    if not REMOTE.match(value):
        return value
    staging = current.get(None)
    if staging is None:   # outside draco's main: the caller publishes current.get()
        current.set(staging := Staging())
    if kind == "input":
        local = fetch(value)
    else:
        target = stage_output(value, is_file=True if kind == "log" else None)
        staging.outputs.append(target)
        local = target.local
    staging.local_to_uri[str(local)] = value.rstrip("/")
    return str(local)
