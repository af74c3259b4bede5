"""The package's public API: every name it lists resolves, importing it stays cheap, and the
package layout keeps one concept per package with no import circles."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import draco_cli

from tests.source_tree import parse

PKG = Path(draco_cli.__file__).parent


def test_every_public_name_resolves():
    for name in draco_cli.__all__:
        assert getattr(draco_cli, name) is not None, name
    assert draco_cli.Scorer.__module__ == "draco_cli.inloop.scorer"


def test_unknown_name_is_an_attribute_error():
    try:
        draco_cli.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("no error")


def test_import_is_cheap():
    code = "import sys, draco_cli; print(sorted(m for m in ('polars', 'pyarrow', 'numpy', 'typer', 'openai') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imports() -> dict[str, set[str]]:
    """Module -> the draco modules it imports anywhere (a deferred import inside a function
    still ties the two modules together)."""
    mods: dict[str, Path] = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    graph: dict[str, set[str]] = {}
    for name, p in mods.items():
        out: set[str] = set()
        for node in ast.walk(parse(p)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draco_cli"):
                out |= {m for m in (f"{node.module}.{a.name}" for a in node.names) if m in mods}
                if node.module in mods:
                    out.add(node.module)
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
        graph[name] = out - {name}
    return graph


def test_no_import_circles_between_modules():
    graph = _imports()
    seen: dict[str, int] = {}  # 1 = on the path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            # a package's __init__ re-exporting its own modules is not a circle
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue
            if seen.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])
    assert cycles == []


def test_no_library_module_over_500_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


# decisions.md and the CHANGELOG name modules and functions that are gone on purpose
USER_DOCS = [PKG.parent / "README.md", *sorted((PKG.parent / "docs").rglob("*.md"))]
DOTTED = re.compile(r"draco_cli(?:\.[A-Za-z_]\w*)+")


def _top_level_names(module: Path) -> set[str]:
    """What a module defines or imports at its top level (read, not imported: importing the
    trainer adapters imports the trainers, seconds each)."""
    names: set[str] = set()
    for node in parse(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _resolves(dotted: str) -> bool:
    """Whether ``draco_cli.a.b`` names a module of the package, or a name a module defines
    (the package itself is imported: its public names are lazy, PEP 562)."""
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        path = PKG.parent.joinpath(*parts[:i])
        module = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if module.is_file():
            rest = parts[i:]
            return not rest or rest[0] in _top_level_names(module)
    return hasattr(draco_cli, parts[1])


@pytest.mark.parametrize("doc", [d for d in USER_DOCS if d.name != "decisions.md"],
                         ids=lambda d: d.name)
def test_every_name_the_docs_give_exists(doc):
    names = {m.group(0) for m in DOTTED.finditer(doc.read_text(encoding="utf-8"))}
    assert [n for n in sorted(names) if not _resolves(n)] == []
