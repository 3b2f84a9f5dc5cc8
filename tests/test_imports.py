"""The package's import graph has no cycle.

Read from the source with `ast`, not by importing: every `import` / `from ... import` of a deform_surgeon module,
wherever it stands (at the top, inside a function, under `if TYPE_CHECKING`), is an edge. An import moved into a
function still makes the two modules depend on each other, so it cannot hide a cycle here: a cycle is broken by
moving what belongs together (docs/architecture.md, "Layers"). `from pkg import sub` where `sub` is a module is an
edge to `sub`; a package's own `__init__` is a node like any other.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import deform_surgeon

PACKAGE = Path(deform_surgeon.__file__).resolve().parent
ROOT = PACKAGE.name


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` is (or lies in: `a.b.func` is `a.b`), None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
                targets = subs + ([source] if len(subs) < len(node.names) else [])
            else:
                continue
            for target in targets:
                known = _known(target, modules) if target.split(".")[0] == ROOT else None
                if known is not None and known != module:
                    graph[module].add(known)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40 and graph[f"{ROOT}.commands.patch"]  # the graph was read: every module, with its imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    """The reader sees imports inside functions, and the search reports a cycle it is given."""
    graph = import_graph()
    assert f"{ROOT}.base.ort_cpu" in graph[f"{ROOT}.graph.fold"]  # fold imports it inside a function only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def private_names_across_modules() -> list[str]:
    """`from X import _name`, and `X._name` where `X` is a name an import bound (a module, or a class or function
    of another module), in every module of the package: `file:line: what`."""
    found = []
    for module, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text(), str(path))
        bound: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{module}:{node.lineno}: from {'.' * node.level}{node.module or ''} import "
                                     f"{a.name}")
                    bound.add(a.asname or a.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound and \
                    node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    """A name with a leading underscore belongs to its module: another module that needs it gets a public name
    (the split pass's tail of a Conv became `blocks.conv_tail` when the bands pass needed it too)."""
    assert private_names_across_modules() == []


def test_the_private_name_reader_sees_both_forms(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("from .b import _hidden\nfrom . import b\nx = b._other\ny = self._mine\n")
    monkeypatch.setattr(sys.modules[__name__], "_modules", lambda: {"pkg.a": tmp_path / "a.py"})
    assert private_names_across_modules() == ["pkg.a:1: from .b import _hidden", "pkg.a:3: b._other"]
