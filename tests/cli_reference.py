"""docs/cli.md, generated from the commands themselves (``python -m tests.cli_reference``).
A test regenerates it and fails when the file is stale or a command lacks help or an example."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer
import typer.core

if TYPE_CHECKING:
    # typer vendors click: get_command returns its Command, which typer does not re-export
    from typer._click.core import Command


def _commands(group: Command, prefix: str = "draco") -> Iterator[tuple[str, Command]]:
    if isinstance(group, typer.core.TyperGroup) and group.commands:
        for name in sorted(group.commands):
            yield from _commands(group.commands[name], f"{prefix} {name}")
    else:
        yield prefix, group


def render() -> str:
    from draco_cli.cli import app

    root = typer.main.get_command(app)
    out = ["# Command-line reference", "",
           "Generated from the commands' own help by `python -m tests.cli_reference`; "
           "`draco COMMAND --help` shows the same.", ""]
    for name, cmd in _commands(root):
        out += [f"## `{name}`", "", (cmd.help or "").strip(), ""]
        params = [p for p in cmd.params if p.name not in ("help",)]
        if params:
            out += ["| option | meaning | default |", "| --- | --- | --- |"]
            for p in params:
                is_option = getattr(p, "param_type_name", "") == "option"
                opts = ", ".join(f"`{o}`" for o in p.opts) if is_option \
                    else f"`{(p.metavar or p.name).upper()}`"
                value = getattr(p.default, "value", p.default)  # enums show their value
                # 0 == False: a zero default is shown, a False flag is not
                empty = value is None or value is False or value in ([], ())
                default = "required" if p.required else ("" if empty else f"`{value}`")
                helptext = (getattr(p, "help", None) or "").replace("|", "\\|").replace("\n", " ")
                out.append(f"| {opts} | {helptext} | {default} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1].startswith("-"):
        sys.exit("usage: python -m tests.cli_reference [FILE]  (default docs/cli.md)")
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/cli.md")
    target.write_text(render())
    print(f"wrote {target}")
