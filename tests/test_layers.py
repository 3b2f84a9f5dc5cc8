"""The package's layers import downward only (docs/architecture.md): each folder of deform_surgeon is a layer, and
a module may import its own layer and those below it, never one above. Read from the source (every import,
those inside functions too), so a new module is held to it the day it is added."""

from __future__ import annotations

import ast
from pathlib import Path

import deform_surgeon

PACKAGE = Path(deform_surgeon.__file__).parent
LAYERS = ["base", "files", "graph", "proofs", "passes", "checks", "commands", "webgpu"]  # bottom to top


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module relative to the package: 'graph.blocks', or '' for the package itself) of every
    import of the package's own modules in `path`."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    package = parts[:-1]  # (an __init__'s package is its folder: the same list)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and (node.module + ".").startswith("deform_surgeon."):
                module = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # `from .. import x`: a layer, or a name of the package's own (__version__)
                found.append((node.lineno, ".".join(module) if module else
                              alias.name if alias.name in LAYERS else ""))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".", 1)[1]) for a in node.names
                      if a.name.startswith("deform_surgeon.")]
    return found


def _layer(module: str) -> int | None:
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else None


def test_every_import_goes_to_the_same_layer_or_below():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "node_modules" in path.parts or path.parent == PACKAGE:  # (the package's API and entry point: any)
            continue
        mine = _layer(path.relative_to(PACKAGE).parts[0])
        assert mine is not None, f"{path}: in no layer folder ({LAYERS})"
        for line, module in _imports(path):
            theirs = _layer(module)
            if module and theirs is None:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}, in no layer")
            elif theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({LAYERS[mine]}) imports {module} "
                              f"({LAYERS[theirs]}, above)")
    assert not upward, "\n".join(upward)


def test_the_top_level_shows_the_layers():
    """`ls deform_surgeon`: the layer folders, the API (`__init__`) and the entry point (`__main__`)."""
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert modules == ["__init__.py", "__main__.py"] and folders == sorted(LAYERS)


def test_an_upward_import_is_found(tmp_path, monkeypatch):
    """The check itself: a module of the base layer importing a command is named."""
    fake = tmp_path / "deform_surgeon"
    (fake / "base").mkdir(parents=True)
    (fake / "base" / "x.py").write_text("def f():\n    from ..commands.patch import patch\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _imports(fake / "base" / "x.py") == [(2, "commands.patch")]
    try:
        test_every_import_goes_to_the_same_layer_or_below()
    except AssertionError as e:
        assert "base/x.py:2 (base) imports commands.patch (commands, above)" in str(e)
    else:
        raise AssertionError("an upward import was not found")
