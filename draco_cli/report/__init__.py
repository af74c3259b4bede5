"""``draco report``: one self-contained HTML file (plotly.js inlined, no network needed to
open it) over one or several run folders written by ``draco run``.

Cross-step figures (rewards against outcomes, unanswered shares, cost) are DuckDB queries over
the run folders' views (``draco_cli.sql``), the same views ``draco sql`` offers; each call log
is read as its totals per phase and status (SQLite sums it), never a row per call, so the
report's memory does not grow with the run. Every text that came from a rollout or from an
LLM is redacted (default patterns) and escaped before it reaches the page."""

from draco_cli.report.page import build_report

__all__ = ["build_report"]
