"""Writes sample_data/appworld_mini.jsonl, the project's hand-made example (see README.md here).

The episodes are written by hand below, in the style of an AppWorld coding agent: each
assistant message thinks aloud and emits one Python code block, and the environment answers
with the block's output as a user message. Token counts (``n_tokens``) are synthetic: each
message counts ceil(characters / 4) plus 4 tokens of chat-template overhead, so the counts are
consistent with each other but come from no real tokenizer.

Run: python sample_data/make_sample.py  (deterministic; the output is committed)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

SYSTEM = (
    "You are a coding agent operating a phone's apps through Python. Call APIs as "
    "apis.<app>.<api>(...). Write one code block per turn; its output comes back to you. "
    "Call apis.supervisor.complete_task() when the task is done."
)

TASKS = {
    "spotify-follow": (
        "Follow every artist who has at least 2 songs in my Spotify playlist 'Road Trip'.",
        "easy",
    ),
    "venmo-roommates": (
        "Request $25 on Venmo from each of my roommates (phone contacts with relation "
        "'roommate') with the note 'utilities'.",
        "medium",
    ),
    "amazon-march": (
        "Find my most expensive Amazon order placed in March 2023 and append its total to my "
        "SimpleNote note titled 'expenses'.",
        "hard",
    ),
}


def turn(thought: str, code: str | None, output: str | None) -> list[dict]:
    content = thought if code is None else f"{thought}\n```python\n{code}\n```"
    msgs = [{"role": "assistant", "content": content}]
    if output is not None:
        msgs.append({"role": "user", "content": f"Output:\n{output}"})
    return msgs


LOGIN_SP = "token = apis.spotify.login(username=apis.supervisor.account('spotify'))['access_token']"
PAGES = "songs = []\npage = 0\nwhile batch := apis.spotify.playlist_songs(token, 'Road Trip', page=page):\n    songs += batch\n    page += 1\nprint(len(songs))"
EPISODES: list[dict] = [
    # --- spotify-follow: paginates and deduplicates (success) ---
    dict(task="spotify-follow", trial=0, outcome=1.0, termination="submitted", turns=[
        turn("First I log in to Spotify.", LOGIN_SP, "ok"),
        turn("The playlist API is paginated, so I read every page.", PAGES, "23"),
        turn("Count songs per artist, deduplicated by artist id.",
             "from collections import Counter\nc = Counter(s['artist_id'] for s in songs)\n"
             "keep = sorted(a for a, n in c.items() if n >= 2)\nprint(keep)", "[11, 42, 57]"),
        turn("Follow the three artists, once each.",
             "for a in keep:\n    apis.spotify.follow_artist(token, artist_id=a)", "ok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # reads only the first page (fails)
    dict(task="spotify-follow", trial=1, outcome=0.0, termination="submitted", turns=[
        turn("Log in.", LOGIN_SP, "ok"),
        turn("Get the playlist songs.",
             "songs = apis.spotify.playlist_songs(token, 'Road Trip')\nprint(len(songs))", "5"),
        turn("Find artists with 2+ songs.",
             "from collections import Counter\nc = Counter(s['artist_id'] for s in songs)\n"
             "keep = [a for a, n in c.items() if n >= 2]\nprint(keep)", "[42]"),
        turn("Follow them.", "for a in keep:\n    apis.spotify.follow_artist(token, artist_id=a)", "ok"),
        turn("Finished.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # paginates but follows an artist twice and prints the password (fails)
    dict(task="spotify-follow", trial=2, outcome=0.0, termination="submitted", turns=[
        turn("I need the password first.",
             "pw = apis.supervisor.account('spotify')['password']\nprint(pw)", "hunter2-sp0t"),
        turn("Log in with it.",
             "token = apis.spotify.login(username='joe@mail.com', password=pw)['access_token']", "ok"),
        turn("Read all pages.", PAGES, "23"),
        turn("Follow artists of songs that repeat.",
             "seen = set()\nfor s in songs:\n    if s['artist_id'] in seen:\n"
             "        apis.spotify.follow_artist(token, artist_id=s['artist_id'])\n"
             "    seen.add(s['artist_id'])",
             "ok\nWarning: already following artist 42"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # recovers from an API error (success)
    dict(task="spotify-follow", trial=3, outcome=1.0, termination="submitted", turns=[
        turn("Log in.", LOGIN_SP, "ok"),
        turn("Read the playlist.", "songs = apis.spotify.playlist_songs(token, 'Road trip', page=0)",
             "Error 404: playlist 'Road trip' not found"),
        turn("The name is case-sensitive; list playlists to get it exactly.",
             "print([p['title'] for p in apis.spotify.playlists(token)])",
             "['Road Trip', 'Focus', 'Gym']"),
        turn("Now read every page of 'Road Trip'.", PAGES, "23"),
        turn("Artists with at least two songs, each once.",
             "from collections import Counter\nc = Counter(s['artist_id'] for s in songs)\n"
             "for a in sorted(a for a, n in c.items() if n >= 2):\n"
             "    apis.spotify.follow_artist(token, artist_id=a)", "ok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # --- venmo-roommates ---
    dict(task="venmo-roommates", trial=0, outcome=1.0, termination="submitted", turns=[
        turn("Find roommates in the contacts.",
             "rm = [c for c in apis.phone.contacts(relation='roommate')]\n"
             "print([c['email'] for c in rm])", "['ana@x.com', 'bo@x.com']"),
        turn("Request $25 from each.",
             "for c in rm:\n    apis.venmo.request_money(email=c['email'], amount=25, "
             "note='utilities')", "ok\nok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # wrong amount: splits $25 between them (fails)
    dict(task="venmo-roommates", trial=1, outcome=0.0, termination="submitted", turns=[
        turn("Get roommates.",
             "rm = apis.phone.contacts(relation='roommate')\nprint(len(rm))", "2"),
        turn("Split the $25 between them.",
             "for c in rm:\n    apis.venmo.request_money(email=c['email'], amount=12.5, "
             "note='utilities')", "ok\nok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # keeps going after completing (fails: hits the turn cap)
    dict(task="venmo-roommates", trial=2, outcome=0.0, termination="max_turns", turns=[
        turn("Get roommates.",
             "rm = apis.phone.contacts(relation='roommate')\nprint([c['email'] for c in rm])",
             "['ana@x.com', 'bo@x.com']"),
        turn("Request the money.",
             "for c in rm:\n    apis.venmo.request_money(email=c['email'], amount=25, "
             "note='utilities')", "ok\nok"),
        turn("Let me double check the requests went out.",
             "print(apis.venmo.requests(status='pending'))", "[{'to': 'ana@x.com'}, {'to': 'bo@x.com'}]"),
        turn("Check again to be sure.",
             "print(apis.venmo.requests(status='pending'))", "[{'to': 'ana@x.com'}, {'to': 'bo@x.com'}]"),
        turn("And once more.", "print(apis.venmo.requests())", "Maximum number of turns reached."),
    ]),
    # answers in prose and never acts (no_action)
    dict(task="venmo-roommates", trial=3, outcome=0.0, termination=None, turns=[
        turn("I cannot send money requests on your behalf; please open Venmo and request "
             "$25 from each roommate yourself.", None, None),
    ]),
    # --- amazon-march ---
    dict(task="amazon-march", trial=0, outcome=1.0, termination="submitted", turns=[
        turn("List March 2023 orders, all pages.",
             "orders, p = [], 0\nwhile b := apis.amazon.orders(start='2023-03-01', "
             "end='2023-03-31', page=p):\n    orders += b\n    p += 1\nprint(len(orders))", "14"),
        turn("Pick the most expensive.",
             "top = max(orders, key=lambda o: o['total'])\nprint(top['total'])", "318.40"),
        turn("Append it to the note.",
             "n = apis.simple_note.search('expenses')[0]\n"
             "apis.simple_note.update(n['id'], content=n['content'] + '\\n318.40')", "ok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # uses March 2024 (wrong year) (fails)
    dict(task="amazon-march", trial=1, outcome=0.0, termination="submitted", turns=[
        turn("Orders from last March.",
             "orders = apis.amazon.orders(start='2024-03-01', end='2024-03-31')\n"
             "print(len(orders))", "3"),
        turn("Most expensive.",
             "top = max(orders, key=lambda o: o['total'])\nprint(top['total'])", "45.99"),
        turn("Save it.",
             "n = apis.simple_note.search('expenses')[0]\n"
             "apis.simple_note.update(n['id'], content=n['content'] + '\\n45.99')", "ok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # overwrites the note instead of appending (fails)
    dict(task="amazon-march", trial=2, outcome=0.0, termination="submitted", turns=[
        turn("March 2023 orders, paginated.",
             "orders, p = [], 0\nwhile b := apis.amazon.orders(start='2023-03-01', "
             "end='2023-03-31', page=p):\n    orders += b\n    p += 1\nprint(len(orders))", "14"),
        turn("The maximum.", "print(max(o['total'] for o in orders))", "318.40"),
        turn("Write it to the note.",
             "n = apis.simple_note.search('expenses')[0]\n"
             "apis.simple_note.update(n['id'], content='318.40')", "ok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
    # crashes on an off-by-one date range, then fixes it (success)
    dict(task="amazon-march", trial=3, outcome=1.0, termination="submitted", turns=[
        turn("Orders in March 2023.",
             "orders = apis.amazon.orders(start='2023-03-01', end='2023-03-32')",
             "ValueError: day is out of range for month"),
        turn("March has 31 days; fix the end date and read every page.",
             "orders, p = [], 0\nwhile b := apis.amazon.orders(start='2023-03-01', "
             "end='2023-03-31', page=p):\n    orders += b\n    p += 1\nprint(len(orders))", "14"),
        turn("Append the largest total to the note.",
             "top = max(o['total'] for o in orders)\n"
             "n = apis.simple_note.search('expenses')[0]\n"
             "apis.simple_note.update(n['id'], content=n['content'] + f'\\n{top:.2f}')", "ok"),
        turn("Done.", "apis.supervisor.complete_task()", "task completed"),
    ]),
]


def n_tokens(text: str) -> int:
    return math.ceil(len(text) / 4) + 4


def main() -> None:
    out = Path(__file__).with_name("appworld_mini.jsonl")
    lines = []
    for ep in EPISODES:
        instruction, difficulty = TASKS[ep["task"]]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": instruction}]
        for t in ep["turns"]:
            messages += t
        for m in messages:
            m["n_tokens"] = n_tokens(m["content"])
        row = {
            "rollout_id": f"{ep['task']}-{ep['trial']}",
            "task_id": ep["task"],
            "train_step": 0,
            "trial": ep["trial"],
            "scenario_id": "errands",
            "difficulty": difficulty,
            "instruction": instruction,
            "outcome": ep["outcome"],
            "messages": messages,
        }
        if ep["termination"] is not None:
            row["termination"] = ep["termination"]
        lines.append(json.dumps(row, ensure_ascii=False))
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} rollouts to {out}")


if __name__ == "__main__":
    main()
