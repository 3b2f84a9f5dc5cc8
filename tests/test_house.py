"""The house rules a newcomer can rely on, read from the files: no module of the package over 600 lines and no
function over 80 (a module does one job, a function tells one step), `commands/patch.py` the road in at most 250
lines, tests/ mirroring the layers (at most 8 test files directly in it), no docs page over 25,000 bytes and the
README at most 20,000 (one subject a page; depth goes to docs/)."""

from __future__ import annotations

import ast
from pathlib import Path

import deform_surgeon

PACKAGE = Path(deform_surgeon.__file__).parent
ROOT = PACKAGE.parent
MODULE_LINES, FUNCTION_LINES, ROAD_LINES = 600, 80, 250
PAGE_BYTES, README_BYTES, TOP_LEVEL_TESTS = 25_000, 20_000, 8


def _modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "node_modules" not in p.parts]


def test_no_module_over_600_lines_and_the_road_within_250() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert long == {}
    assert len((PACKAGE / "commands" / "patch.py").read_text().splitlines()) <= ROAD_LINES


def test_no_function_over_80_lines() -> None:
    long = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in _modules() for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > FUNCTION_LINES]
    assert long == []


def test_tests_mirror_the_layers() -> None:
    top = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert len(top) <= TOP_LEVEL_TESTS, top


def test_docs_pages_and_readme_sizes() -> None:
    large = {p.name: n for p in sorted((ROOT / "docs").glob("*.md")) if (n := p.stat().st_size) > PAGE_BYTES}
    assert large == {}
    assert (ROOT / "README.md").stat().st_size <= README_BYTES

