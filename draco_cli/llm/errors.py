"""Errors of the LLM layer."""

from __future__ import annotations

from draco_cli.errors import DracoError, UsageError


class LLMError(DracoError):
    """A call failed for good (authentication, a bad request, retries exhausted)."""


class ReplayMiss(LLMError):
    """A replay/ model was asked something its recorded call log does not hold."""


class ModelSpecError(UsageError):
    pass


class RequestRejected(LLMError):
    """The server refused the request itself (a 4xx, or a 500 repeating the same body): sending
    it again cannot help. ``body`` is the server's reply, kept in the call log."""

    def __init__(self, message: str, *, body: str | None = None, status: int | None = None):
        super().__init__(message)
        self.body = body
        self.status = status


class Retryable(Exception):
    """A failure worth another attempt (429, 5xx, timeout, dropped connection). ``body`` is
    the server's own text (scrubbed), so a 500 that repeats the same body can be told from a
    transient one; ``kind`` is "http", "timeout", "refused" or "connection"; ``logged``:
    whether the fleet logged the failure itself."""

    def __init__(self, message: str, retry_after: float | None = None, *,
                 body: str | None = None, kind: str = "http", status: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.body = body
        self.kind = kind
        self.status = status
        self.logged = False


class BudgetReached(Exception):
    """A call not sent: the budget (``--max-cost``) is spent or committed."""


class ReplyRefused(Exception):
    """A reply draco will not use: its body is larger than ``--max-reply-mib`` (before or after
    decompression), or its token counts are impossible (negative, not whole numbers, absurd).
    The call's samples end unanswered with this reason (a rerun asks them again); nothing it
    reported is counted, so its cost is 0 and the ``--max-cost`` total is never lowered."""
