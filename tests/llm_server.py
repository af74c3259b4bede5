"""The local protocol server moved into the package (``draco llm mock-server``); this name is
kept for the tests and scripts that import it from here."""

from draco_cli.llm.mockserver import FakeLLMServer, default_answer, schema_answer  # noqa: F401
