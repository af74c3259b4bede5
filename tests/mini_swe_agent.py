"""mini-swe-agent (SWE-bench) trajectories as openai-jsonl lines, built here (no such log is
in ../shared/data). The messages follow mini-swe-agent's loop: a system prompt asking for
exactly one ```bash block per reply, the task, then assistant replies ("THOUGHT: ..." and one
bash block) each answered by a user turn with ``<returncode>`` and ``<output>`` — or, when the
reply held no bash block or several, by a format error and nothing run.

What makes these logs hard: the agent quotes code in its thought as ```python blocks, writes
files through here-documents whose text holds fences of its own, and passes multi-line
quoted scripts to ``python -c``. Each trajectory records how many bash blocks ran
(``executed``) next to the messages, so a test can count.
"""

from __future__ import annotations

from typing import Any

SYSTEM = ("You are a helpful assistant that can interact with a computer shell. Your reply must "
          "contain a THOUGHT section and exactly ONE bash code block with one command.")
FORMAT_ERROR = ("Please always provide EXACTLY ONE action in triple backticks, found {n} "
                "actions.")


def _out(text: str, code: int = 0) -> str:
    return f"<returncode>{code}</returncode>\n<output>\n{text}\n</output>"


REPLIES: list[tuple[str, str | None]] = [
    # (assistant reply, observation; None = a format error follows)
    ("THOUGHT: The issue says `parse()` drops the last field. The current code reads:\n\n"
     "```python\ndef parse(line):\n    return line.split(',')[:-1]\n```\n\n"
     "Let me find it in the repository.\n\n```bash\ngrep -rn \"def parse\" src/\n```",
     _out("src/csvlite/core.py:12:def parse(line):")),
    ("THOUGHT: I write a reproduction script first. Its docstring shows the expected use.\n\n"
     "```bash\ncat <<'EOF' > reproduce.py\n\"\"\"Usage:\n\n```python\n"
     ">>> parse('a,b,c')\n['a', 'b', 'c']\n```\n\"\"\"\nfrom csvlite.core import parse\n"
     "print(parse('a,b,c'))\nEOF\npython reproduce.py\n```",
     _out("['a', 'b']")),
    ("THOUGHT: Confirmed. I could fix it with sed:\n\n```bash\nsed -i 's/[:-1]//' src/x.py\n"
     "```\n\nor with a Python one-liner:\n\n```bash\npython - <<'PY'\nprint('x')\nPY\n```",
     None),
    ("THOUGHT: One command then. I fix the slice in place and check it.\n\n```bash\n"
     "python -c \"\nimport pathlib\np = pathlib.Path('src/csvlite/core.py')\n"
     "p.write_text(p.read_text().replace(\\\"split(',')[:-1]\\\", \\\"split(',')\\\"))\n"
     "\" && python reproduce.py\n```",
     _out("['a', 'b', 'c']")),
    ("THOUGHT: The fix works. A note for the changelog, in Markdown:\n\n```markdown\n"
     "- `parse()` keeps the last field\n```\n\nI submit.\n\n```bash\n"
     "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached\n```",
     _out("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a/src/csvlite/core.py ...")),
]


def trajectory(instance: str, trial: int, resolved: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"<pr_description>\n{instance}: parse() drops the last "
                                    "field of a line.\n</pr_description>"},
    ]
    executed = 0
    for reply, obs in REPLIES:
        messages.append({"role": "assistant", "content": reply})
        if obs is None:
            messages.append({"role": "user", "content": FORMAT_ERROR.format(n=2)})
        else:
            executed += 1
            messages.append({"role": "user", "content": obs})
    return {"rollout_id": f"{instance}-{trial}", "task_id": instance, "trial": trial,
            "outcome": 1.0 if resolved else 0.0, "termination": "submitted",
            "messages": messages, "executed": executed}
