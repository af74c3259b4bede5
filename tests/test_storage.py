"""Inputs and outputs on object storage: the real CLI (a subprocess) against moto's S3 server,
started here on a local port — never a real bucket. The same commands with local paths are the
reference: the tables read back from the bucket must equal them, and the faults (a missing
bucket, no credentials, an unreachable endpoint, a failed command) are one line, exit 1, and
leave nothing new in the bucket."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated

import polars as pl
import pytest
import typer

from draco_cli.cli.options import IN, LOG, OUT
from tests.conftest import TAU, run_draco
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted
from tests.test_run import SAMPLE_RA, SAMPLE_SA, calls_in, paid_twice

pytest.importorskip("moto")
pafs = pytest.importorskip("pyarrow.fs")

RUN_TABLES = ["rubric/rubrics.parquet", "judge/verdicts.parquet", "credit/rewards.parquet",
              "credit/step_credit.parquet", "credit/token_advantages.parquet"]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3-compatible server in its own process on a free local port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """A fresh bucket on the local server, the environment pointing at it, a fresh cache."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("DRACO_CACHE_DIR", str(tmp_path / "cache"))
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    fs = pafs.S3FileSystem(endpoint_override=s3_server, access_key="testing",
                           secret_key="testing", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir(bucket)
    return Bucket(fs, bucket)


class Bucket:
    def __init__(self, fs, name: str) -> None:
        self.fs, self.name = fs, name

    def uri(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def put(self, key: str, local) -> str:
        with open(local, "rb") as f, self.fs.open_output_stream(f"{self.name}/{key}") as out:
            out.write(f.read())
        return self.uri(key)

    def keys(self, prefix: str = "") -> list[str]:
        sel = pafs.FileSelector(f"{self.name}/{prefix}".rstrip("/"), recursive=True,
                                allow_not_found=True)
        return sorted(i.path.split("/", 1)[1] for i in self.fs.get_file_info(sel)
                      if i.type == pafs.FileType.File)

    def read(self, key: str) -> bytes:
        with self.fs.open_input_stream(f"{self.name}/{key}") as f:
            return f.read()

    def table(self, key: str) -> pl.DataFrame:
        return pl.read_parquet(io.BytesIO(self.read(key)))


@pytest.fixture
def llm(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-storage-000000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def run_args(rollouts, steps, out, server, *extra):
    return ["run", "--rollouts", str(rollouts), "--steps", str(steps), "--model", "openai/m",
            "--base-url", server.url + "/v1", "-o", str(out), *extra]


def test_ingest_reads_and_writes_the_bucket(s3, tmp_path):
    src = s3.put("logs/tau.json", TAU)
    res = run_draco("ingest", "tau-bench", src, "--tokenizer", "approx", "-o", s3.uri("tables"))
    assert res.returncode == 0, res.stderr.decode()
    # the message names where the tables are, the bucket, not the local cache
    assert f"→ {s3.uri('tables')}" in res.stderr.decode(), res.stderr.decode()
    assert run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx", "-o",
                     str(tmp_path / "local")).returncode == 0
    for t in ("rollouts.parquet", "steps.parquet"):
        assert s3.table(f"tables/{t}").equals(pl.read_parquet(tmp_path / "local" / t)), t


def test_run_on_the_bucket_equals_local_and_resumes_from_it(s3, llm, tmp_path):
    """draco run with inputs and the run folder in the bucket: the same tables as a local run;
    a rerun on another machine (an empty cache) finds the run folder and its call log in the
    bucket and pays nothing; a report reads the run folder from the bucket."""
    ro, st = s3.put("in/rollouts.parquet", SAMPLE_RA), s3.put("in/steps.parquet", SAMPLE_SA)
    assert run_draco(*run_args(SAMPLE_RA, SAMPLE_SA, tmp_path / "local", llm)).returncode == 0
    hits = sum(llm.hits.values())
    res = run_draco(*run_args(ro, st, s3.uri("runs/a"), llm))
    assert res.returncode == 0, res.stderr.decode()
    # where the outputs are: the bucket, not this machine's cache
    said = res.stderr.decode()
    assert f"token advantages: {s3.uri('runs/a')}/credit/token_advantages.parquet" in said
    assert f"next: draco report {s3.uri('runs/a')} -o" in said
    for t in RUN_TABLES:
        assert s3.table(f"runs/a/{t}").equals(pl.read_parquet(tmp_path / "local" / t)), t
    assert "runs/a/manifest.json" in s3.keys() and "runs/a/llm_calls.sqlite" in s3.keys()
    assert not [k for k in s3.keys() if k.endswith((".lock", ".tmp", "-wal", "-shm"))]
    paid = sum(llm.hits.values()) - hits
    assert paid > 0

    os.environ["DRACO_CACHE_DIR"] = str(tmp_path / "other-machine")
    res = run_draco(*run_args(ro, st, s3.uri("runs/a"), llm, "--redo", "rubric"))
    assert res.returncode == 0, res.stderr.decode()
    assert sum(llm.hits.values()) - hits == paid          # nothing paid twice
    (tmp_path / "log.sqlite").write_bytes(s3.read("runs/a/llm_calls.sqlite"))
    assert paid_twice(tmp_path / "log.sqlite") == 0
    assert calls_in(tmp_path / "log.sqlite") == calls_in(tmp_path / "local" / "llm_calls.sqlite")

    res = run_draco("report", s3.uri("runs/a"), "-o", s3.uri("reports/a.html"))
    assert res.returncode == 0, res.stderr.decode()
    assert s3.read("reports/a.html").lower().startswith(b"<!doctype html>")


def test_failed_command_publishes_nothing_and_the_rerun_resumes(s3, monkeypatch, tmp_path):
    """A run whose judge server is down fails its health check (exit 1): nothing appears in
    the bucket. The rerun with the server up resumes from the staged run folder."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-storage-000000000000")
    ro, st = s3.put("in/rollouts.parquet", SAMPLE_RA), s3.put("in/steps.parquet", SAMPLE_SA)
    down = FakeLLMServer(answer=scripted).start()
    down.stop()
    res = run_draco(*run_args(ro, st, s3.uri("runs/b"), down, "--timeout", "2"))
    assert res.returncode == 1, res.stderr.decode()
    assert s3.keys("runs") == []
    up = FakeLLMServer(answer=scripted).start()
    try:
        res = run_draco(*run_args(ro, st, s3.uri("runs/b"), up))
    finally:
        up.stop()
    assert res.returncode == 0, res.stderr.decode()
    assert "runs/b/credit/token_advantages.parquet" in s3.keys()


def one_line_error(res) -> str:
    err = res.stderr.decode().strip()
    assert res.returncode == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


def test_missing_bucket_is_one_line(s3, tmp_path):
    missing = "s3://no-such-bucket-here/x/rollouts.parquet"
    err = one_line_error(run_draco("validate", missing))
    assert "no such bucket 'no-such-bucket-here'" in err and missing in err
    err = one_line_error(run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                                   "-o", "s3://no-such-bucket-here/out"))
    assert "no such bucket" in err
    err = one_line_error(run_draco("validate", s3.uri("absent.parquet")))
    assert s3.uri("absent.parquet") in err and "no such file" in err


def test_missing_credentials_is_one_line(s3, monkeypatch):
    src = s3.put("logs/tau.json", TAU)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    err = one_line_error(run_draco("ingest", "tau-bench", src, "--tokenizer", "approx", "-o",
                                   s3.uri("out")))
    assert "no AWS credentials" in err
    assert s3.keys("out") == []


def test_unreachable_endpoint_is_one_line(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    err = one_line_error(run_draco("ingest", "tau-bench", str(TAU), "--tokenizer", "approx",
                                   "-o", s3.uri("out")))
    assert "cannot reach the storage endpoint http://127.0.0.1:9" in err


def spelling_app(seen: dict):
    """A command whose path options declare their kinds as draco's do (options.IN/OUT/LOG)."""
    app = typer.Typer()

    @app.command()
    def cmd(inp: Annotated[Path, typer.Argument(parser=IN)],
            steps: Annotated[Path | None, typer.Option("--steps", parser=IN)] = None,
            call_log: Annotated[Path | None, typer.Option("--call-log", parser=LOG)] = None,
            out: Annotated[Path | None, typer.Option("-o", "--out", parser=OUT)] = None,
            base_url: Annotated[str | None, typer.Option("--base-url")] = None) -> None:
        seen.update(inp=inp, steps=steps, call_log=call_log, out=out, base_url=base_url)

    return app


def stage_command(argv: list[str]):
    """(the values the command saw, the invocation's Staging) for ``argv``."""
    from typer.testing import CliRunner

    from draco_cli import storage

    seen: dict = {}
    token = storage.current.set(staged := storage.Staging())
    try:
        res = CliRunner().invoke(spelling_app(seen), argv)
    finally:
        storage.current.reset(token)
    assert res.exit_code == 0, res.output
    return seen, staged


def test_a_file_uri_is_its_local_path(tmp_path):
    res = run_draco("eval", "--rollouts", (tmp_path.parent / "x y.parquet").as_uri())
    assert f"{tmp_path.parent / 'x y.parquet'}: no such file" in res.stderr.decode()
    res = run_draco("eval", "--rollouts", Path(SAMPLE_RA).as_uri(), "--json")
    assert res.returncode == 0, res.stderr.decode()


def test_base_urls_and_local_paths_are_left_alone():
    argv = ["r.parquet", "--base-url", "http://localhost:8000/v1", "--steps", "s.parquet",
            "-o", "runs/a"]
    seen, staged = stage_command(argv)
    assert seen == {"inp": Path("r.parquet"), "steps": Path("s.parquet"), "call_log": None,
                    "out": Path("runs/a"), "base_url": "http://localhost:8000/v1"}
    assert staged.outputs == [] and staged.local_to_uri == {}


def test_ray_engine_on_the_bucket_equals_local(s3, llm, tmp_path):
    """--engine ray with the inputs and the run folder in the bucket (a local Ray cluster
    started by the command): the tables the local engine writes for local paths."""
    pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ro, st = s3.put("in/rollouts.parquet", SAMPLE_RA), s3.put("in/steps.parquet", SAMPLE_SA)
    assert run_draco(*run_args(SAMPLE_RA, SAMPLE_SA, tmp_path / "local", llm)).returncode == 0
    # a process of its own: the command starts (and leaves) its own local Ray cluster, which
    # must not stay joined in the test process (tests/trainers start theirs)
    res = run_draco(*run_args(ro, st, s3.uri("runs/r"), llm, "--engine", "ray",
                              "--partitions", "2"), process=True)
    assert res.returncode == 0, res.stderr.decode()
    for t in RUN_TABLES:
        assert s3.table(f"runs/r/{t}").equals(pl.read_parquet(tmp_path / "local" / t)), t
    assert "runs/r/ray/part-0/llm_calls.sqlite" in s3.keys()


def test_every_spelling_of_a_remote_option_is_staged(s3, tmp_path):
    """--opt VALUE, --opt=VALUE, -oVALUE and positional values; -o/--out and --call-log are
    outputs (published), every other path option an input (fetched); publish uploads only
    changes."""
    src = s3.put("in/rollouts.parquet", SAMPLE_RA)
    s3.put("logs/calls.sqlite", SAMPLE_RA)   # any bytes: staged as they are
    seen, staged = stage_command([src, f"--steps={src}", "--call-log",
                                  s3.uri("logs/calls.sqlite"), "-o" + s3.uri("out/x.parquet")])
    local_in, steps, log, out = seen["inp"], seen["steps"], seen["call_log"], seen["out"]
    assert open(local_in, "rb").read() == open(SAMPLE_RA, "rb").read()
    assert steps == local_in
    assert open(log, "rb").read() == open(SAMPLE_RA, "rb").read()     # pulled to resume
    assert not os.path.exists(out)
    assert [o.uri for o in staged.outputs] == [s3.uri("logs/calls.sqlite"), s3.uri("out/x.parquet")]
    open(out, "wb").write(b"new table")
    assert staged.outputs[0].publish() == 0     # the log unchanged: not uploaded
    assert staged.outputs[1].publish() == 1
    assert s3.read("out/x.parquet") == b"new table"
    staged.publish()                              # again: nothing new
    assert staged.outputs[1].publish() == 0
    assert staged.name_remote(f"{local_in}: row 3") == f"{src}: row 3"


def test_sql_fetches_its_remote_inputs(s3):
    """draco sql's inputs are plain arguments (folders, files, then the query): the remote
    ones are fetched too."""
    src = s3.put("in/rollouts.parquet", SAMPLE_RA)
    res = run_draco("sql", src, "SELECT count(*) AS n FROM rollouts", "--json")
    assert res.returncode == 0, res.stderr.decode()
    assert b'"n"' in res.stdout


def test_gcs_gives_up_in_seconds_not_minutes_and_says_which_credentials():
    # Google's client retries 15 minutes by default when no credential answers (seen: a
    # `draco eval gs://...` silent past 60 s); draco's file system stops after 30 s
    from draco_cli import storage

    fs, path = storage.filesystem("gs://bucket/dir/x.parquet")
    assert path == "bucket/dir/x.parquet"
    assert fs.__reduce__()[1][0]["retry_time_limit"].total_seconds() == \
        storage.GCS_RETRY_SECONDS == 30
    # the message pyarrow 26 gives then (a run here without credentials, 36 s)
    seen = ("google::cloud::Status(UNAVAILABLE: Retry policy exhausted, with a last message of "
            "Could not create a OAuth2 access token to authenticate the request. The request "
            "was not sent, as such an access token is required to complete the request "
            "successfully.")
    assert storage.describe(OSError(seen), "gs://bucket/x") == (
        "gs://bucket/x: no usable Google Cloud credentials (set GOOGLE_APPLICATION_CREDENTIALS,"
        " or run gcloud auth application-default login)")


def test_azure_without_credentials_is_one_line_not_an_internal_error(monkeypatch):
    from draco_cli import storage

    for k in [k for k in os.environ if k.startswith("AZURE_")]:
        monkeypatch.delenv(k)
    with pytest.raises(storage.StorageError, match=r"^abfs://c@acct/x.parquet: no usable "
                                                   r"Azure credentials"):
        fs, path = storage.filesystem("abfs://c@acct/x.parquet")
        storage._info(fs, path, "abfs://c@acct/x.parquet")
