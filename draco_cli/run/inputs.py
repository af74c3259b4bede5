"""What ``draco run`` checks of its inputs before a stage runs or a call is paid for, and
where its run folder is."""

from __future__ import annotations

from pathlib import Path

from draco_cli.errors import InputError, UsageError


def run_dir_for(out: Path, train_step: int | None) -> Path:
    if train_step is not None and train_step < 0:
        raise UsageError(f"--train-step {train_step}: must be ≥ 0")
    return Path(out) / f"step-{train_step}" if train_step is not None else Path(out)

def check_train_step(rollouts: Path, train_step: int | None) -> None:
    """Rollouts whose own ``train_step`` names another step would reach the trainer labelled
    with it, and the loader refuses step N's file when its rows say another: after every call
    was paid for. A column that cannot be read is left to the credit stage's checks."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if train_step is None:
        return
    try:
        pf = pq.ParquetFile(rollouts)
        if "train_step" not in pf.schema_arrow.names:
            return
        # as the credit stage reads it (a "3" is step 3); what does not cast is its to name
        steps = pc.cast(pf.read(columns=["train_step"]).column(0), pa.int64())
        other = [v for v in pc.unique(steps).to_pylist() if v is not None and v != train_step]
    except (pa.ArrowException, OSError):
        return
    if other:
        raise InputError(f"train_step is {other[0]!r} in some rows, not --train-step "
                         f"{train_step}: the trainer would refuse these token advantages as "
                         f"step {train_step}'s (run each step on the rollouts ingested for it)",
                         file=str(rollouts), field="train_step")


def row_count(path: Path) -> int:
    """A table's rows from its Parquet footer (the manifest is rewritten at every stage: reading
    the tables themselves would hold the largest of them in memory each time)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.is_dir():
        raise InputError("is a folder, expected a Parquet file", file=str(path))
    try:
        return int(pq.read_metadata(path).num_rows)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"not a readable Parquet file ({exc})", file=str(path)) from None


def check_model(model: str) -> None:
    from draco_cli.llm.providers import parse_model_id

    provider, name = parse_model_id(model)
    if provider == "replay" and not Path(name).is_file():
        raise InputError("no such call log (replay/ needs a recorded llm_calls.sqlite)",
                         file=name)
