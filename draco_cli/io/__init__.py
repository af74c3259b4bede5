"""Reading and writing draco tables: Parquet files, or ``-`` for a table on stdin (Parquet or
Arrow IPC) or an Arrow IPC stream on stdout. Checks at every read, atomic writes and output
sets: docs/data-contracts.md."""

from draco_cli.io.checks import conform, require_finite
from draco_cli.io.files import (
    STDIO,
    atomic_path,
    check_writable,
    prepare_out_dir,
    write_text_atomic,
)
from draco_cli.io.outputs import (
    JOURNAL_FILE,
    SET_ID_KEY,
    SET_MEMBERS_KEY,
    BlockWriter,
    OutputSet,
    TableWriter,
    folder_lock,
)
from draco_cli.io.tables import (
    as_frame,
    contract_table,
    read_arrow,
    read_stdin_table,
    read_table,
    write_table,
)

__all__ = [
    "BlockWriter",
    "JOURNAL_FILE",
    "OutputSet",
    "SET_ID_KEY",
    "SET_MEMBERS_KEY",
    "STDIO",
    "TableWriter",
    "as_frame",
    "atomic_path",
    "check_writable",
    "conform",
    "contract_table",
    "folder_lock",
    "prepare_out_dir",
    "read_arrow",
    "read_stdin_table",
    "read_table",
    "require_finite",
    "write_table",
    "write_text_atomic",
]
