"""Options shared by several commands, as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Force = Annotated[bool, typer.Option("--force", help="Overwrite existing outputs.")]
OutDir = Annotated[Path, typer.Option("-o", "--out", help="Output folder.", show_default=False)]
