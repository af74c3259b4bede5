"""Records sample_data/llm_calls.sqlite, the call log that lets `draco run` work offline on the
sample with `--model replay/sample_data/llm_calls.sqlite`.

How the recorded answers were made: NOT by a language model. This script plays the rubric
writer and the judge by hand: the criteria below and every verdict (with its cited steps) were
written by the draco authors from reading the twelve sample episodes. The script serves them
through draco's local test server (tests/llm_server.py, speaking the OpenAI protocol on
127.0.0.1) while `draco run` runs for real, so the log holds exactly the prompts draco sends.

Run from the repository root (needs the dev extras): python sample_data/record_calls.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CRITERIA = {
    "spotify-follow": [
        ("Reads every playlist page", "Reads every page of the 'Road Trip' playlist before "
         "counting songs per artist."),
        ("Follows each qualifying artist once", "Follows every artist with at least two songs in "
         "the playlist, each exactly once."),
        ("Keeps the password out of outputs", "Never prints or logs the Spotify password."),
        ("Recovers from API errors", "When an API call fails, fixes the call instead of giving "
         "up or repeating it."),
    ],
    "venmo-roommates": [
        ("Requests $25 from each roommate", "Sends a request of exactly $25 to every roommate "
         "contact."),
        ("Uses the note 'utilities'", "Every request carries the note 'utilities'."),
        ("Stops once the requests are sent", "Completes the task right after the requests, "
         "without further checks or calls."),
    ],
    "amazon-march": [
        ("Uses the March 2023 date range", "Queries orders placed from 2023-03-01 to "
         "2023-03-31."),
        ("Reads every page of orders", "Reads all pages of the order list before picking the "
         "maximum."),
        ("Appends rather than overwrites", "Appends the total to the 'expenses' note and keeps "
         "its existing content."),
    ],
}

# rollout -> criterion index -> (verdict, cited steps), written by hand from the episodes
VERDICTS = {
    "spotify-follow-0": [("pass", [2]), ("pass", [3, 4]), ("pass", [1]), ("na", [])],
    "spotify-follow-1": [("fail", [2]), ("fail", [3, 4]), ("pass", [1]), ("na", [])],
    "spotify-follow-2": [("pass", [3]), ("fail", [4]), ("fail", [1]), ("na", [])],
    "spotify-follow-3": [("pass", [4]), ("pass", [5]), ("pass", [1]), ("pass", [2, 3])],
    "venmo-roommates-0": [("pass", [2]), ("pass", [2]), ("pass", [3])],
    "venmo-roommates-1": [("fail", [2]), ("pass", [2]), ("pass", [3])],
    "venmo-roommates-2": [("pass", [2]), ("pass", [2]), ("fail", [3, 4, 5])],
    "venmo-roommates-3": [("fail", []), ("na", []), ("na", [])],
    "amazon-march-0": [("pass", [1]), ("pass", [1]), ("pass", [3])],
    "amazon-march-1": [("fail", [1]), ("fail", [1]), ("pass", [3])],
    "amazon-march-2": [("pass", [1]), ("pass", [1]), ("fail", [3])],
    "amazon-march-3": [("pass", [2]), ("pass", [2]), ("pass", [3])],
}


# The static setting judges every rollout against draco's default rubric
# (draco_cli/rubric/default.yaml), in its order: secrets, pagination, stopping, error recovery,
# dates, confirmation before changes. Also written by hand from the episodes.
STATIC_VERDICTS = {
    "spotify-follow-0": [("pass", [1]), ("pass", [2]), ("pass", [5]), ("na", []), ("na", []),
                         ("pass", [4])],
    "spotify-follow-1": [("pass", [1]), ("fail", [2]), ("pass", [5]), ("na", []), ("na", []),
                         ("fail", [4])],
    "spotify-follow-2": [("fail", [1]), ("pass", [3]), ("pass", [5]), ("na", []), ("na", []),
                         ("fail", [4])],
    "spotify-follow-3": [("pass", [1]), ("pass", [4]), ("pass", [6]), ("pass", [2, 3]),
                         ("na", []), ("pass", [5])],
    "venmo-roommates-0": [("pass", [2]), ("na", []), ("pass", [3]), ("na", []), ("na", []),
                          ("pass", [2])],
    "venmo-roommates-1": [("pass", [2]), ("na", []), ("pass", [3]), ("na", []), ("na", []),
                          ("fail", [2])],
    "venmo-roommates-2": [("pass", [2]), ("na", []), ("fail", [3, 4, 5]), ("na", []),
                          ("na", []), ("pass", [2])],
    "venmo-roommates-3": [("na", []), ("na", []), ("na", []), ("na", []), ("na", []),
                          ("na", [])],
    "amazon-march-0": [("pass", [2]), ("pass", [1]), ("pass", [4]), ("na", []), ("pass", [1]),
                       ("pass", [3])],
    "amazon-march-1": [("pass", [2]), ("fail", [1]), ("pass", [4]), ("na", []), ("fail", [1]),
                       ("fail", [3])],
    "amazon-march-2": [("pass", [2]), ("pass", [1]), ("pass", [4]), ("na", []), ("pass", [1]),
                       ("fail", [3])],
    "amazon-march-3": [("pass", [3]), ("pass", [2]), ("pass", [4]), ("pass", [1, 2]),
                       ("fail", [1]), ("pass", [3])],
}

# The runs recorded into the one log: default settings, the static settings, three samples.
RUNS = ([], ["--setting", "static"], ["--setting", "static-no-credit"], ["--samples", "3"])


def main() -> None:
    import polars as pl

    from tests.llm_server import FakeLLMServer

    data = REPO / "sample_data" / "appworld_mini"
    steps = pl.read_parquet(data / "steps.parquet")
    from draco_cli.redact import Redactor

    red = Redactor()  # the prompt shows actions after draco's default redaction
    actions = {rid: [red(a) for a in g.sort("step")["action"].to_list()]
               for (rid,), g in steps.partition_by("rollout_id", as_dict=True).items()}
    rollouts = pl.read_parquet(data / "rollouts.parquet")
    task_of = dict(zip(rollouts["rollout_id"], rollouts["task_id"]))

    def task_in(text: str) -> str:
        instr = dict(zip(rollouts["task_id"], rollouts["instruction"]))
        return next(t for t, i in instr.items() if i in text)

    def rollout_in(text: str) -> str:
        # the judged rollout: the one whose every action appears, in order, in the prompt
        fits = [rid for rid, acts in actions.items() if task_of[rid] == task_in(text)
                and all(a in text for a in acts)]
        fits = fits or [rid for rid in VERDICTS if task_of[rid] == task_in(text)
                        and not actions.get(rid)]
        return max(fits, key=lambda r: len(actions.get(r, [])))

    def answer(body: dict, i: int) -> str:
        # the system text is every stage's; what a request asks follows the data in its user
        # message (the grading instructions are in every request's system text)
        user = body["messages"][1]["content"]
        if "strict grader" in user:
            rid = rollout_in(user)
            titles = [c[0] for c in CRITERIA[task_of[rid]]]
            out = []
            for line in re.findall(r"^\{.*\}$", user, flags=re.M):
                c = json.loads(line)
                if c["title"] in titles:
                    verdict, cites = VERDICTS[rid][titles.index(c["title"])]
                else:
                    verdict, cites = STATIC_VERDICTS[rid][static_titles.index(c["title"])]
                out.append({"criterion_id": c["id"], "verdict": verdict, "cited_steps": cites,
                            "reason": f"{c['title']}: {verdict} (judged by hand)"})
            return json.dumps({"verdicts": out})
        crit = CRITERIA[task_in(user)]
        return json.dumps({"criteria": [{"title": t, "requirement": r} for t, r in crit]})

    from draco_cli.rubric.core import load_static_rubric

    static_titles = [c["title"] for c in load_static_rubric(None)]
    os.environ.setdefault("OPENAI_API_KEY", "sk-local-recording-only")
    server = FakeLLMServer(answer=answer).start()
    tmp = Path(tempfile.mkdtemp())
    try:
        logs = []
        for k, extra in enumerate(RUNS):
            res = subprocess.run([sys.executable, "-m", "draco_cli", "run", "--rollouts",
                                  str(data / "rollouts.parquet"), "--steps",
                                  str(data / "steps.parquet"), "--model", "openai/hand-written",
                                  "--base-url", server.url + "/v1", "-o", str(tmp / f"run{k}"),
                                  *extra], cwd=REPO, capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(res.stderr)
            logs.append(tmp / f"run{k}" / "llm_calls.sqlite")
            print(" ".join(extra) or "default settings", "\n", res.stderr)
        merge_logs(logs, REPO / "sample_data" / "llm_calls.sqlite")
        print(f"recorded {server.hits['chat']} calls → sample_data/llm_calls.sqlite")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def merge_logs(logs: list[Path], out: Path) -> None:
    """One log holding every run's rows, each answered (request, sample) once."""
    import sqlite3

    tmp_out = out.with_suffix(".tmp")
    tmp_out.unlink(missing_ok=True)
    shutil.copy(logs[0], tmp_out)
    conn = sqlite3.connect(tmp_out)
    conn.execute("PRAGMA journal_mode=DELETE")
    cols = [r[1] for r in conn.execute("PRAGMA table_info(calls)") if r[1] != "id"]
    for other in logs[1:]:
        conn.execute("ATTACH ? AS o", (str(other),))
        conn.execute(
            f"INSERT INTO calls ({', '.join(cols)}) SELECT {', '.join(cols)} FROM o.calls "
            "WHERE NOT EXISTS (SELECT 1 FROM calls c WHERE c.content_hash = o.calls.content_hash "
            "AND c.sample IS o.calls.sample AND c.status = 'ok' AND o.calls.status = 'ok')")
        conn.commit()
        conn.execute("DETACH o")
    conn.execute("VACUUM")
    conn.close()
    tmp_out.replace(out)
    for suffix in ("-wal", "-shm"):
        Path(str(out) + suffix).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
