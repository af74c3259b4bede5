"""Checks of tables against their contracts and against each other (``draco validate``).

Unlike a read, which stops at the first broken rule, validation collects every problem it can
find, each naming file, row and field, so a user fixes a log in one pass."""

from draco_cli.validate.folder import validate_targets
from draco_cli.validate.issues import raise_first
from draco_cli.validate.tokens import (
    FlatSpans,
    flat_policy_spans,
    policy_span_issues,
    token_advantage_issues,
)

__all__ = [
    "FlatSpans",
    "flat_policy_spans",
    "policy_span_issues",
    "raise_first",
    "token_advantage_issues",
    "validate_targets",
]
