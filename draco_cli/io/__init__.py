"""Reading and writing draco tables.

- Parquet files, or ``-`` for a table on stdin (Parquet or Arrow IPC) or an Arrow IPC stream
  on stdout (never onto a terminal), so commands chain in pipes.
- Every read is checked against the table's contract (``draco_cli.schemas``) with whole-column
  operations; the first offending row of each broken rule is named with file, row and field.
- Every write is atomic (a temporary file in the destination folder, then ``os.replace``), and
  refuses to replace an existing file unless ``force`` is set.
- A command's outputs are one *output set* (``OutputSet``): written into a hidden staging
  folder under a per-folder lock, then published by renames recorded in a journal, so a set
  appears whole or not at all, and carries one id in every table's metadata."""

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
    recover_folder,
)
from draco_cli.io.tables import (
    _to_arrow,
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
    "_to_arrow",
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
    "recover_folder",
    "require_finite",
    "write_table",
    "write_text_atomic",
]
