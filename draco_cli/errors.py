"""One error hierarchy for the library; the CLI maps it to messages and exit codes."""

from __future__ import annotations


class DracoError(Exception):
    """Base of every error draco raises on purpose. Exit code 1 at the command line."""

    exit_code = 1


class UsageError(DracoError):
    """The call itself is wrong (options that do not fit together). Exit code 2."""

    exit_code = 2


class InputError(DracoError):
    """Bad input data, located as precisely as we can: file, row (or entry) and field."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        row: int | str | None = None,
        field: str | None = None,
    ) -> None:
        self.file = file
        self.row = row
        self.field = field
        self.detail = message
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.file is not None:
            where.append(str(self.file))
        if self.row is not None:
            where.append(self.row if isinstance(self.row, str) else f"row {self.row}")
        if self.field is not None:
            where.append(f"field '{self.field}'")
        return (": ".join(where) + ": " if where else "") + self.detail


class OutputExistsError(DracoError):
    """Refusing to overwrite an existing output without --force."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} already exists; pass --force to overwrite it")
        self.path = path


class ValidationFailed(DracoError):
    """A set of tables broke their contracts; carries every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        head = f"{len(problems)} problem(s) found"
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in problems))
