"""The package's shape, held by checks on its source: folders in one order of layers (a module
imports only from its own folder or the folders below), no import circles (``TYPE_CHECKING``
imports count), about ten modules per folder, one typed interpreter (nothing takes
``build: Any``), error context written in one place, and no function-local import without a
comment saying why."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "gograph"
#: The generated bindings of the core's two flavors (gopy's output, not the project's code).
GENERATED = ("_core_cpu", "_core_cuda")
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if not set(p.relative_to(PACKAGE).parts) & set(GENERATED))
#: The folders from the top down ("" the public surface): a module imports from its own folder
#: and the folders after it, never from one before it.
LAYERS = ("integrations", "", "probes", "build", "replay", "request", "runtime", "core", "support")


def _name(path: pathlib.Path) -> str:
    """The module's dotted name below ``gograph`` (``runtime.engines``, ``graphs``; ``__init__``
    of a folder is the folder's name)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _folder(name: str) -> str:
    return name.split(".")[0] if "." in name or name in LAYERS else ""


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _resolve(path: pathlib.Path, node: ast.ImportFrom) -> list[str]:
    """The package's modules a relative import names (dotted below ``gograph``)."""
    here = list(path.relative_to(PACKAGE).parent.parts)
    base = here[: len(here) - (node.level - 1)] if node.level <= len(here) + 1 else []
    known = {_name(p) for p in MODULES}
    out = []
    for alias in node.names if node.module is None else [None]:
        parts = base + (node.module.split(".") if node.module else []) + ([alias.name] if alias else [])
        while parts and ".".join(parts) not in known:
            parts = parts[:-1]  # a name imported from a module, not a module
        if parts and not set(parts) & set(GENERATED):
            out.append(".".join(parts))
    return out


def _relative_imports(path: pathlib.Path) -> Iterator[tuple[str, ast.ImportFrom, bool]]:
    """(module imported, the node, whether inside a function) for every relative import of the
    package's own modules."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level >= 1:
                for t in _resolve(path, child):
                    yield t, child, in_function
            yield from visit(child, inner)

    yield from visit(_tree(path), False)


def _against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    rank = {f: i for i, f in enumerate(LAYERS)}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if rank[_folder(a)] > rank[_folder(b)])


def _graph() -> dict[str, set[str]]:
    return {_name(p): {m for m, _, _ in _relative_imports(p) if m != _name(p)} for p in MODULES}


def test_every_folder_is_a_layer() -> None:
    folders = {p.relative_to(PACKAGE).parts[0] for p in MODULES if len(p.relative_to(PACKAGE).parts) > 1}
    assert folders == set(LAYERS) - {""}


def test_imports_follow_the_layers() -> None:
    """integrations -> the public surface -> probes -> build -> replay -> request -> runtime ->
    core -> support: the folders' ``__init__`` docstrings say what each owns."""
    assert _against_the_layers(_graph()) == []


def test_the_layer_check_sees_an_import_upward() -> None:
    assert _against_the_layers({"core._core": {"runtime.engines"}, "runtime.engines": {"core._core"}}) == [
        "core._core -> runtime.engines"
    ]
    assert _against_the_layers({"graphs": {"build._build"}, "integrations.megatron": {"graphs"}}) == []


def test_about_ten_modules_per_folder() -> None:
    per: dict[str, int] = {}
    for p in MODULES:
        if p.name != "__init__.py":
            per[_folder(_name(p))] = per.get(_folder(_name(p)), 0) + 1
    assert max(per.values()) <= 10, per


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
    assert _cycles(_graph()) == []


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
    src = (PACKAGE / "probes" / "_probe.py").read_text()
    assert "Build" not in {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    assert "build._build" not in {m for m, _, _ in _relative_imports(PACKAGE / "probes" / "_probe.py")}


@pytest.mark.parametrize("module", ["probes._probe", "probes._recarve"])
def test_the_build_imports_no_observer(module: str) -> None:
    """The seed's trace and the debug recorder are hooks the caller injects."""
    assert module not in {m for m, _, _ in _relative_imports(PACKAGE / "build" / "_build.py")}
