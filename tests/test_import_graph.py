"""The package's import graph has no circle: every import statement counts, at any depth (module level,
inside functions, under ``TYPE_CHECKING``), so a lazy import is no way around it.

A circle makes the order of imports matter and hides which module owns what; the layout of
crisp_runtime (planning, residency, scheduling, execution, cpu, hf, storage) is meant to be read from the
file tree, one direction at a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# installed name -> folder in the repository (pyproject.toml's package-dir)
PACKAGES = {"crisp_kernels": "crisp_kernels", "crisp_runtime": "crisp_runtime", "crisp_bench": "bench",
            "crisp_tools": "tools"}


def module_files(root: Path) -> dict[str, Path]:
    mods = {}
    for name, folder in PACKAGES.items():
        for f in sorted((root / folder).rglob("*.py")):
            parts = [name, *f.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (the deepest module each imported name resolves to)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in PACKAGES and (target := resolve(name)) not in (None, mod):
                    graph[mod].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    found = circles(import_graph(module_files(ROOT)))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("kind", ["module level", "lazy", "type checking"])
def test_a_circle_is_found(tmp_path, kind):
    """The check itself: a two-module circle made of each kind of import is reported."""
    pkg = tmp_path / "crisp_runtime"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    import_b = {"module level": "from crisp_runtime.b import g\n",
                "lazy": "def f():\n    from . import b\n",
                "type checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import g\n"}[kind]
    (pkg / "a.py").write_text(import_b)
    (pkg / "b.py").write_text("import crisp_runtime.a\n")
    for folder in ("crisp_kernels", "bench", "tools"):
        (tmp_path / folder).mkdir()
    assert circles(import_graph(module_files(tmp_path))) == [["crisp_runtime.a", "crisp_runtime.b"]]
