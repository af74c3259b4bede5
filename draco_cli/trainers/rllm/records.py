"""rLLM's saved episodes (``rllm eval --save-episodes`` files, ``Episode.to_dict()`` dumps as
``.json``/``.jsonl``, a folder of them), read as plain dicts; see docs/trainers.md, "rLLM"
("Offline"). A ``.json`` file holds one episode or a list; ``to_dict()`` leaves the step
``id`` out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draco_cli.errors import InputError


def episode_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix == ".json" and q.is_file())
            if not found:
                raise InputError("no .json episode files in this folder", file=str(p))
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise InputError("no such file", file=str(p))
    return files


def _load(text: str, file: str, row: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                         file=file, row=row) from None


def _checked(ep: Any, file: str, row: str) -> dict[str, Any]:
    if not isinstance(ep, dict) or not isinstance(ep.get("trajectories"), list):
        raise InputError("not an rLLM episode (an object with a 'trajectories' list)",
                         file=file, row=row, field="trajectories")
    if not isinstance(ep.get("id", ep.get("episode_id")), str):
        raise InputError("episode without a string 'id' (rLLM's Episode.id, 'task:index')",
                         file=file, row=row, field="id")
    return ep


def read_episodes(paths: list[Path]) -> Iterator[tuple[Path, str, dict[str, Any]]]:
    """(file, where in it, episode dict) for every episode in ``paths``, in order."""
    for path in episode_files(paths):
        file = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                             file=file) from None
        if path.suffix == ".jsonl":
            lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
            for n, line in lines:
                yield path, f"line {n}", _checked(_load(line, file, f"line {n}"), file,
                                                  f"line {n}")
            if not lines:
                raise InputError("no episodes in this file", file=file)
            continue
        data = _load(text, file, "document")
        items = data if isinstance(data, list) else [data]
        if not items:
            raise InputError("no episodes in this file", file=file)
        for i, ep in enumerate(items):
            where = f"episode {i}" if isinstance(data, list) else "episode"
            yield path, where, _checked(ep, file, where)
