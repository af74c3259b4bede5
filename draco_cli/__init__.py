"""draco: dynamic rubrics and step-level credit for RL on LLM agents.

The library never prints and never exits; the command layer lives in ``draco_cli.cli``.
"""

__version__ = "0.1.0"
