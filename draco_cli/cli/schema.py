from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from draco_cli.cli.console import err_console
from draco_cli.cli.options import OUT

app = typer.Typer(help="The table contracts.", no_args_is_help=True)


@app.command("export")
def export(
    folder: Annotated[Path, typer.Argument(parser=OUT,
                                           help="Folder to write <table>.json files into.")],
) -> None:
    """Write the JSON Schema of every table into FOLDER.

    Example: draco schema export schemas/
    """
    from draco_cli.schemas import SCHEMA_VERSION
    from draco_cli.schema_export import export_json_schemas

    written = export_json_schemas(folder)
    err_console.print(f"wrote {len(written)} schemas (version {SCHEMA_VERSION}) to {folder}")
