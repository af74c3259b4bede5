"""Errors of the LLM layer."""

from __future__ import annotations

from draco_cli.errors import DracoError, UsageError


class LLMError(DracoError):
    """A call failed for good (authentication, a bad request, retries exhausted)."""


class ReplayMiss(LLMError):
    """A replay/ model was asked something its recorded call log does not hold."""


class ModelSpecError(UsageError):
    pass
