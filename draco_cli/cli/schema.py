from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import OUT

app = typer.Typer(help="The table contracts.", no_args_is_help=True)


def render_json_schemas() -> dict[str, str]:
    """Each table's JSON Schema file, by table name, for users outside Python."""
    import json

    from draco_cli.schemas import TABLES, json_schema

    return {name: json.dumps(json_schema(model), indent=2, sort_keys=True) + "\n"
            for name, model in TABLES.items()}


@app.command("export")
def export(
    folder: Annotated[Path, typer.Argument(parser=OUT,
                                           help="Folder to write <table>.json files into.")],
) -> None:
    """Write the JSON Schema of every table into FOLDER.

    Example: draco schema export schemas/
    """
    from draco_cli.io import write_text_atomic
    from draco_cli.schemas import SCHEMA_VERSION

    schemas = render_json_schemas()
    for name, text in schemas.items():
        write_text_atomic(folder / f"{name}.json", text, force=True)
    err_console.print(f"wrote {len(schemas)} schemas (version {SCHEMA_VERSION}) to {folder}")
