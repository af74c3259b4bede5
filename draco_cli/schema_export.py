"""JSON Schema files of the tables, for users outside Python (``draco schema export``)."""

from __future__ import annotations

import json
from pathlib import Path

from draco_cli.io import write_text_atomic
from draco_cli.schemas import TABLES, json_schema


def render_json_schemas() -> dict[str, str]:
    return {name: json.dumps(json_schema(model), indent=2, sort_keys=True) + "\n"
            for name, model in TABLES.items()}


def export_json_schemas(folder: str | Path) -> list[Path]:
    out = Path(folder)
    written = []
    for name, text in render_json_schemas().items():
        path = out / f"{name}.json"
        write_text_atomic(path, text, force=True)
        written.append(path)
    return written
