"""Checks of tables against their contracts and against each other (``draco validate``).

Unlike a read, which stops at the first broken rule, validation collects every problem it can
find, each naming file, row and field, so a user fixes a log in one pass."""

from draco_cli.validate.folder import (
    LLM_CALLS,
    LLM_CALLS_COLUMNS,
    Loaded,
    check_citations,
    check_known_rollouts,
    check_llm_calls,
    check_manifest,
    check_output_sets,
    check_rollouts,
    check_rollouts_steps,
    check_steps,
    folder_sets,
    validate_paths,
    validate_targets,
)
from draco_cli.validate.issues import MAX_PER_RULE, Issue, detect_table, raise_first
from draco_cli.validate.tokens import (
    FlatSpans,
    _policy_span_issues_general,
    check_token_advantages,
    flat_policy_spans,
    policy_span_issues,
    token_advantage_issues,
)

__all__ = [
    "FlatSpans",
    "Issue",
    "LLM_CALLS",
    "LLM_CALLS_COLUMNS",
    "Loaded",
    "MAX_PER_RULE",
    "_policy_span_issues_general",
    "check_citations",
    "check_known_rollouts",
    "check_llm_calls",
    "check_manifest",
    "check_output_sets",
    "check_rollouts",
    "check_rollouts_steps",
    "check_steps",
    "check_token_advantages",
    "detect_table",
    "flat_policy_spans",
    "folder_sets",
    "policy_span_issues",
    "raise_first",
    "token_advantage_issues",
    "validate_paths",
    "validate_targets",
]
