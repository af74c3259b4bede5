"""The command layer: thin typer commands over library functions.

Library errors are mapped here, once, to a message on stderr and an exit code
(1 = failure, 2 = usage). Set DRACO_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING

import typer
import typer.main

from draco_cli import storage
from draco_cli.cli import audit as audit_cmd
from draco_cli.cli import credit as credit_cmd
from draco_cli.cli import evaluate as eval_cmd
from draco_cli.cli import export as export_cmd
from draco_cli.cli import ingest as ingest_cmd
from draco_cli.cli import judge as judge_cmd
from draco_cli.cli import llm as llm_cmd
from draco_cli.cli import replay as replay_cmd
from draco_cli.cli import report as report_cmd
from draco_cli.cli import rubric as rubric_cmd
from draco_cli.cli import run as run_cmd
from draco_cli.cli import schema as schema_cmd
from draco_cli.cli import sql as sql_cmd
from draco_cli.cli import validate as validate_cmd
from draco_cli.cli.console import err_console

if TYPE_CHECKING:
    from typer._click.core import Command

app = typer.Typer(
    name="draco",
    help="Dynamic rubrics and step-level credit for RL on LLM agents: "
    "rollout logs in, per-token advantages out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("ingest")(ingest_cmd.ingest)
app.command("validate")(validate_cmd.validate)
app.command("eval")(eval_cmd.evaluate)
app.command("run")(run_cmd.run)
app.command("report")(report_cmd.report)
app.command("sql")(sql_cmd.sql)
app.command("export")(export_cmd.export)
app.add_typer(rubric_cmd.app, name="rubric")
app.add_typer(judge_cmd.app, name="judge")
app.add_typer(credit_cmd.app, name="credit")
app.add_typer(audit_cmd.app, name="audit")
app.add_typer(replay_cmd.app, name="replay")
app.add_typer(llm_cmd.app, name="llm")
app.add_typer(schema_cmd.app, name="schema")


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", metavar="",
                                 help="Print the version and exit."),
) -> None:
    if version:
        from draco_cli import __version__

        typer.echo(__version__)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(2)


@functools.cache
def command() -> Command:
    """The click command typer builds from ``app``, built once per process: the build reads
    every command's signature (~0.1 s), which a Python caller invoking the CLI again and again
    (tests, notebooks) would otherwise pay per call."""
    return typer.main.get_command(app)


def main() -> None:
    from draco_cli._allocator import tune_allocator
    from draco_cli.errors import DracoError

    # the only option before a command is --version/--help: argv[1] names the command
    tune_allocator(release_polars_pages=sys.argv[1:2] == ["run"])
    # remote paths (s3://…) are staged by the path options as they are parsed, into this
    # invocation's Staging; its outputs are published only if the command succeeds
    storage.current.set(staged := storage.Staging())
    try:
        # Not standalone: usage errors come out here too, so every error has one style.
        code = command()(args=sys.argv[1:], standalone_mode=False)
        code = code if isinstance(code, int) else 0
        if code == 130:   # typer turns Ctrl-C into this exit code before `except` below sees it
            _fail("interrupted (nothing was published; rerun to resume)", 130)
        if code == 0:
            staged.publish()
        sys.exit(code)
    except typer.TyperException as exc:   # click's errors: usage (exit 2) and the others
        from rich.markup import escape

        ctx = getattr(exc, "ctx", None)
        message = exc.format_message()
        # A group called without a command: its help. Typer's rich help is printed as the
        # error is made (the message is then empty); asking ctx.get_help() would print it again.
        # By name, as typer itself tells it apart (the class moved between click and typer).
        if type(exc).__name__ == "NoArgsIsHelpError":
            if message:
                typer.echo(message)
            sys.exit(2)
        hint = f" (see '{ctx.command_path} -h')" if ctx is not None and exc.exit_code == 2 \
            else ""
        message = message.replace("Value error, ", "")  # pydantic's prefix
        err_console.print(f"[bold red]error:[/] {escape(message)}{hint}",
                          highlight=False, markup=True, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("[bold red]error:[/] aborted", highlight=False)
        sys.exit(130)
    except (DracoError, OSError, RecursionError, MemoryError) as exc:
        if os.environ.get("DRACO_DEBUG"):
            raise
        _fail(*_known_failure(exc))
    except KeyboardInterrupt:
        _fail("interrupted (nothing was published; rerun to resume)", 130)
    except Exception as exc:  # noqa: BLE001 — the last line of defence against a traceback
        if os.environ.get("DRACO_DEBUG"):
            raise
        _fail(*_unexpected_failure(exc))


def _known_failure(exc: BaseException) -> tuple[str, int]:
    """(message, exit code) of a failure every command may meet."""
    from draco_cli.errors import DracoError, describe_os_error

    if isinstance(exc, DracoError):
        return str(exc), exc.exit_code
    if isinstance(exc, OSError):
        # The generic failures of any command (a full disk, a read-only folder, no permission,
        # a path through a file), mapped once here so every command inherits the wording.
        return describe_os_error(exc), 1
    if isinstance(exc, RecursionError):
        return "input nested too deeply to process", 1
    return "out of memory (nothing was written); try a smaller input", 1


def _unexpected_failure(exc: Exception) -> tuple[str, int]:
    import sqlite3

    if isinstance(exc, sqlite3.Error):  # e.g. "database or disk is full"
        return f"call log: {exc}", 1
    first = (str(exc).splitlines() or [""])[0][:300]
    return (f"internal error ({type(exc).__name__}: {first}); rerun with DRACO_DEBUG=1 for "
            "the traceback, and please report it", 1)


def _fail(message: str, code: int) -> None:
    from rich.markup import escape

    from draco_cli.llm.keys import scrub

    staged = storage.current.get(None)
    if staged is not None:
        message = staged.name_remote(message)
    err_console.print(f"[bold red]error:[/] {escape(scrub(message) or '')}",
                      highlight=False, markup=True, soft_wrap=True)
    sys.exit(code)
