"""The executor's shape, held by checks on the package's source: one typed interpreter (nothing
takes ``build: Any``), error context written in one place, no import circles (``TYPE_CHECKING``
imports count), and no function-local import without a comment saying why."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "gograph"
MODULES = sorted(p for p in PACKAGE.glob("*.py"))


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _relative_imports(path: pathlib.Path) -> Iterator[tuple[str, ast.ImportFrom, bool]]:
    """(module imported, the node, whether inside a function) for every ``from . import`` and
    ``from .x import`` of the package's own modules."""
    names = {p.stem for p in MODULES}

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level == 1:
                targets = [child.module] if child.module else [a.name for a in child.names]
                for t in targets:
                    if t.split(".")[0] in names:
                        yield t.split(".")[0], child, in_function
            yield from visit(child, inner)

    yield from visit(_tree(path), False)


def test_no_function_takes_build_any() -> None:
    offenders = [f"{p.name}: {ln.strip()}" for p in MODULES for ln in p.read_text().splitlines() if "build: Any" in ln]
    assert offenders == []


def test_error_context_is_written_in_one_place() -> None:
    """The build's phase and callable are set by ``Build._enter`` alone (two writes)."""
    writes = []
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for leaf in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(leaf, ast.Attribute) and leaf.attr in ("phase", "current"):
                            writes.append(f"{path.name}:{node.lineno} .{leaf.attr}")
    assert len(writes) <= 2, writes


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package() -> None:
    graph = {p.stem: {m for m, _, _ in _relative_imports(p) if m != p.stem} for p in MODULES}
    assert _cycles(graph) == []


def test_function_local_imports_say_why() -> None:
    """An import inside a function hides an arrow of the import graph: each says why it is there,
    in a comment on its line or the line above."""
    bare = []
    for path in MODULES:
        lines = path.read_text().splitlines()
        for node in ast.walk(_tree(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    here, above = lines[inner.lineno - 1], lines[inner.lineno - 2]
                    if "#" not in here and not above.strip().startswith("#"):
                        bare.append(f"{path.name}:{inner.lineno}: {here.strip()}")
    assert bare == []


def test_the_probe_does_not_drive_the_build() -> None:
    """``plan_memory`` runs the build until planned; ``_probe`` only observes it (hooks)."""
    src = (PACKAGE / "_probe.py").read_text()
    assert "Build" not in {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    assert "_build" not in {m for m, _, _ in _relative_imports(PACKAGE / "_probe.py")}


@pytest.mark.parametrize("module", ["_probe", "_recarve"])
def test_the_build_imports_no_observer(module: str) -> None:
    """The seed's trace and the debug recorder are hooks the caller injects."""
    assert module not in {m for m, _, _ in _relative_imports(PACKAGE / "_build.py")}
