from __future__ import annotations

import json

import pyarrow as pa

from draco_cli.cli.schema import render_json_schemas
from draco_cli.schemas import TABLES, Rollout, Step, TokenAdvantages, arrow_schema
from tests.conftest import REPO


def test_exported_json_schemas_are_current():
    rendered = render_json_schemas()
    on_disk = {p.stem: p.read_text() for p in (REPO / "schemas").glob("*.json")}
    assert set(on_disk) == set(rendered), "run: draco schema export schemas/"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"schemas/{name}.json is stale; run: draco schema export schemas/"


def test_every_spec_table_has_a_model():
    assert {"rollouts", "steps", "rubric_candidates", "rubrics", "verdicts_raw",
            "verdicts", "rewards", "step_credit", "token_advantages"} <= set(TABLES)


def test_every_audit_and_eval_output_has_a_contract():
    assert {"agreement", "tests", "overlap", "overlap_units", "rubric_summary",
            "rubric_criteria", "cost_phase", "cost_step", "cost_category", "metrics"} <= set(TABLES)


def test_arrow_types_follow_the_contract():
    r = arrow_schema(Rollout)
    assert r.field("train_step").type == pa.int32() and r.field("train_step").nullable
    assert r.field("rollout_id").type == pa.string() and not r.field("rollout_id").nullable
    assert r.field("policy_spans").type == pa.list_(pa.list_(pa.int32()))
    assert arrow_schema(Step).field("n_tokens").type == pa.int32()
    assert arrow_schema(TokenAdvantages).field("advantages").type == pa.list_(pa.float32())
    assert r.metadata[b"draco.table"] == b"rollouts"
    for model in TABLES.values():
        for field in arrow_schema(model):
            assert field.metadata[b"doc"], f"{model.table_name}.{field.name} has no doc"


def test_json_schema_carries_version_and_keys():
    doc = json.loads(render_json_schemas()["steps"])
    assert doc["x-draco-keys"] == ["rollout_id", "step"]
    assert doc["properties"]["step"]["minimum"] == 1
