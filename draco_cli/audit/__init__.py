"""Audits (SPEC §4): can a cheap self-judge stand in for a reference judge, how much do two
rubric writers overlap, what do rubrics look like, and what did the LLM calls cost."""

from draco_cli.audit.cost import (
    AUDIT_COST_COLUMNS,
    billed_vs_naive,
    billed_vs_naive_logs,
    cost_audit,
    cost_categories,
    read_cost_rows,
)
from draco_cli.audit.overlap import lexical_similarity, overlap_audit, rubric_audit
from draco_cli.audit.self_judge import self_judge_audit

__all__ = [
    "AUDIT_COST_COLUMNS",
    "billed_vs_naive",
    "billed_vs_naive_logs",
    "cost_audit",
    "cost_categories",
    "lexical_similarity",
    "overlap_audit",
    "read_cost_rows",
    "rubric_audit",
    "self_judge_audit",
]
