"""``draco report``: one self-contained HTML file over one or several run folders written by
``draco run``. Contents, memory and redaction: see docs/run.md, "The report"."""

from draco_cli.report.page import build_report

__all__ = ["build_report"]
