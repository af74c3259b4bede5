"""Outputs pinned across refactors: the tables that ingest, `draco run`, `credit expand` and
`draco eval` write for the bundled sample and for the real tau-bench and tau2-bench logs are
compared, value for value, with digests recorded before the code was restructured
(``tests/golden_outputs.json``).

The judge on the real logs is the local protocol server answering each request with a valid
instance of its own schema, chosen by a generator seeded with the request's messages: the
answers vary from call to call (so criteria are dropped and kept, credit is spread unevenly)
and are the same on every run.

A change that is meant to change outputs (a new prompt version, a fix) regenerates the file
with ``DRACO_WRITE_GOLDEN=1 python -m pytest tests/test_golden_outputs.py`` and says why in its
commit."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, TAU, TAU2, run_draco
from tests.llm_server import FakeLLMServer

GOLDEN = Path(__file__).with_name("golden_outputs.json")
SAMPLE_R = REPO / "sample_data" / "appworld_mini" / "rollouts.parquet"
SAMPLE_S = REPO / "sample_data" / "appworld_mini" / "steps.parquet"
REPLAY = "replay/sample_data/llm_calls.sqlite"

# Columns of the call-log export that depend on the clock, the server's ids or the machine.
VOLATILE = {"id", "latency_s", "created_at", "batch_id", "response", "endpoint"}
# Schema metadata that names one output set (a fresh id per write).
VOLATILE_META = {b"draco.output_set", b"draco.output_set_members"}


def _seeded_instance(schema: dict[str, Any], rng: random.Random, root: dict[str, Any]) -> Any:
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return _seeded_instance(node, rng, root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return _seeded_instance(rng.choice(schema["anyOf"]), rng, root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind == "object":
        return {k: _seeded_instance(v, rng, root)
                for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        lo = max(schema.get("minItems", 1), 1)
        hi = min(schema.get("maxItems", lo + 2), lo + 2)
        return [_seeded_instance(schema.get("items") or {}, rng, root)
                for _ in range(rng.randint(lo, hi))]
    if kind == "integer":
        lo = schema.get("minimum", 1)
        return rng.randint(lo, schema.get("maximum", lo + 5))
    if kind == "number":
        return round(rng.uniform(schema.get("minimum", 0.0), schema.get("maximum", 1.0)), 3)
    if kind == "boolean":
        return rng.random() < 0.5
    return f"answer {rng.randint(0, 999)}"


def seeded_answer(body: dict[str, Any], index: int) -> str:
    from tests.llm_server import _schema_of

    schema = _schema_of(body)
    seed = hashlib.sha256(json.dumps(body.get("messages"), sort_keys=True).encode()).digest()
    rng = random.Random(int.from_bytes(seed[:8], "big") + index)
    return json.dumps(_seeded_instance(schema, rng, schema) if schema else {})


def digest_table(path: Path) -> str:
    """Schema, draco's schema metadata and every value of one Parquet table, hashed."""
    table = pq.read_table(path)
    if path.name == "llm_calls.parquet":  # logged in the order the answers arrived
        table = table.sort_by([("request_hash", "ascending"), ("sample", "ascending"),
                               ("attempt", "ascending")])
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()
            if k not in VOLATILE_META and k.startswith(b"draco.")}
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for field in table.schema:
        if path.name == "llm_calls.parquet" and field.name in VOLATILE:
            continue
        h.update(f"{field.name}:{field.type}".encode())
        values = table.column(field.name).to_pylist()
        if pa.types.is_floating(field.type):  # polars' parallel sums may differ in the last bit
            values = [None if v is None else float(f"{v:.12g}") for v in values]
        h.update(json.dumps(values, default=repr).encode())
    return h.hexdigest()


def digest_folder(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): digest_table(p)
            for p in sorted(folder.rglob("*.parquet"))}


def _ok(res) -> None:
    assert res.returncode == 0, res.stderr.decode(errors="replace")


def outputs_sample(tmp: Path, _server: FakeLLMServer) -> dict[str, str]:
    _ok(run_draco("run", "--rollouts", SAMPLE_R, "--steps", SAMPLE_S, "--model", REPLAY,
                  "-o", tmp / "run"))
    _ok(run_draco("credit", "expand", "--token-advantages",
                  tmp / "run" / "credit" / "token_advantages.parquet",
                  "-o", tmp / "expanded" / "dense.parquet"))
    _ok(run_draco("eval", "--rollouts", SAMPLE_R, "-o", tmp / "eval"))
    return digest_folder(tmp)


def _outputs_real(log: Path, fmt: str, tmp: Path, server: FakeLLMServer) -> dict[str, str]:
    _ok(run_draco("ingest", fmt, log, "--tokenizer", "approx", "-o", tmp / "ingest"))
    _ok(run_draco("run", "--rollouts", tmp / "ingest" / "rollouts.parquet",
                  "--steps", tmp / "ingest" / "steps.parquet", "--model", "openai/golden",
                  "--base-url", server.url + "/v1", "--min-answered", "0",
                  # groups of one trial in these logs: every advantage is 0, said and allowed
                  "--allow-no-signal", "-o", tmp / "run"))
    _ok(run_draco("eval", "--rollouts", tmp / "ingest" / "rollouts.parquet", "-o", tmp / "eval"))
    return digest_folder(tmp)


def outputs_tau(tmp: Path, server: FakeLLMServer) -> dict[str, str]:
    return _outputs_real(TAU, "tau-bench", tmp, server)


def outputs_tau2(tmp: Path, server: FakeLLMServer) -> dict[str, str]:
    return _outputs_real(TAU2, "tau2-bench", tmp, server)


CASES = {"sample": outputs_sample, "tau-bench": outputs_tau, "tau2-bench": outputs_tau2}


@pytest.fixture
def golden_server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-golden-000000000000")
    s = FakeLLMServer(answer=seeded_answer).start()
    yield s
    s.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_unchanged(case, tmp_path, golden_server):
    if case != "sample" and not TAU.exists():
        pytest.skip(f"reads the real logs, missing here: {TAU}")
    got = CASES[case](tmp_path, golden_server)
    assert got, "no tables were written"
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("DRACO_WRITE_GOLDEN"):
        recorded[case] = got
        GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    assert got == recorded[case]
