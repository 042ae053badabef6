"""Every ```python block of README.md and docs/*.md runs, so a snippet cannot rot.

The blocks of one markdown file run in order in one namespace, as a reader pastes them into one
session. Without a GPU each block is rewritten by one documented rule before it runs:

* ``"cuda"`` becomes ``"cpu"`` and ``.cuda()`` becomes ``.cpu()`` (gograph then runs its eager
  engine: the same API and lifecycle);
* every integer literal of 256 or more is divided by 16 (``1024`` -> ``64``), so the sizes the
  docs show for a GPU run in moments on a CPU; shapes keep their ratios.

An HTML comment on the line right above a block's fence says more, e.g. ``<!-- snippet: cuda -->``:

* ``cuda`` -- the block cannot run on a CPU (it needs CUDA itself); it runs only in the cuda-marked
  test, on a GPU, unrewritten;
* ``needs=MODULE`` -- the block imports an optional package; without it that block is not run (a
  warning says so) and the others are.

A block that defines a function named like a gograph export (a signature shown as a stub) is
compared with the real signature: parameter names, kinds and defaults must match.
"""

from __future__ import annotations
import __future__

import gc
import importlib.util
import inspect
import io
import re
import tokenize
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import gograph

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\s*$")
MARK = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
SHRINK_FROM, SHRINK_BY = 256, 16
#: Blocks compile as with ``from __future__ import annotations``: a signature stub's annotations
#: name types the block does not import.
ANNOTATIONS = __future__.annotations.compiler_flag


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    marks: tuple[str, ...]

    @property
    def needs(self) -> tuple[str, ...]:
        return tuple(m.split("=", 1)[1] for m in self.marks if m.startswith("needs="))


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i
            mark = MARK.match(lines[i - 1]) if i else None
            i += 1
            body = []
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            marks = tuple(mark.group(1).split()) if mark else ()
            out.append(Block(path, start + 1, "\n".join(body) + "\n", marks))
        i += 1
    return out


def for_cpu(code: str) -> str:
    """The module docstring's rule: cuda -> cpu, integer literals >= 256 divided by 16."""
    lines = code.splitlines(keepends=True)
    edits = []
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        text = None
        if tok.type == tokenize.NUMBER and tok.string.isdigit() and int(tok.string) >= SHRINK_FROM:
            text = str(int(tok.string) // SHRINK_BY)
        elif tok.type == tokenize.STRING and tok.string.strip("\"'") == "cuda":
            text = '"cpu"'
        elif tok.type == tokenize.NAME and tok.string == "cuda" and previous == ".":
            text = "cpu"
        if text is not None:
            edits.append((tok.start, tok.end, text))
        previous = tok.string
    for (row, col), (_, end), text in reversed(edits):  # tokens never span lines here
        line = lines[row - 1]
        lines[row - 1] = line[:col] + text + line[end:]
    return "".join(lines)


def _check_signatures(block: Block, before: set[str], namespace: dict[str, object]) -> None:
    for name, value in namespace.items():
        if name in before or not inspect.isfunction(value) or not hasattr(gograph, name):
            continue
        shown, real = inspect.signature(value), inspect.signature(getattr(gograph, name))
        as_tuples = [[(p.name, p.kind, p.default) for p in s.parameters.values()] for s in (shown, real)]
        assert as_tuples[0] == as_tuples[1], f"{block.path.name}:{block.line}: {name}{shown} is not gograph's {real}"


def run_file(path: Path, cuda: bool) -> int:
    """Runs the file's blocks in order; returns how many ran."""
    namespace: dict[str, object] = {"__name__": f"snippets_of_{path.stem}"}
    ran = 0
    try:
        for block in blocks_of(path):
            if "cuda" in block.marks and not cuda:
                continue
            missing = [m for m in block.needs if importlib.util.find_spec(m) is None]
            if missing:  # this block only: the others still run
                warnings.warn(f"{path.name}:{block.line} not run: it needs {', '.join(missing)}", stacklevel=1)
                continue
            code = block.code if cuda else for_cpu(block.code)
            before = set(namespace)
            try:
                compiled = compile(code, f"{path.name}:{block.line}", "exec", flags=ANNOTATIONS)
                exec(compiled, namespace)
            except Exception as e:
                raise AssertionError(f"the python block at {path.name}:{block.line} failed: {e!r}\n{code}") from e
            _check_signatures(block, before, namespace)
            ran += 1
    finally:
        namespace.clear()  # graphed callables go with it: their passes are released
        gc.collect()
    return ran


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_on_the_cpu(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the rewritten blocks run on the CPU
    run_file(path, cuda=False)


@pytest.mark.cuda
@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_on_a_gpu(path: Path, cuda_device: torch.device) -> None:
    run_file(path, cuda=True)


def test_the_rewrite_rule() -> None:
    code = 'm = torch.nn.Linear(1024, 4096).cuda()\nx = torch.randn(64, 1024, device="cuda")  # 1024 rows\n'
    assert for_cpu(code).split("\n")[:2] == [
        "m = torch.nn.Linear(64, 256).cpu()",
        'x = torch.randn(64, 64, device="cpu")  # 1024 rows',
    ]


def test_docs_have_python_blocks_and_marks_are_known() -> None:
    blocks = [b for p in DOCS for b in blocks_of(p)]
    assert len(blocks) >= 10
    for b in blocks:
        for m in b.marks:
            assert m == "cuda" or m.startswith("needs="), f"{b.path.name}:{b.line}: unknown snippet mark {m!r}"


def test_api_md_names_every_export() -> None:
    api = (ROOT / "docs" / "API.md").read_text()
    missing = [name for name in gograph.__all__ if f"`{name}" not in api]
    assert not missing, f"docs/API.md does not document {missing}"


def test_make_graphed_callables_docstring_example_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Example section of ``help(gograph.make_graphed_callables)``, run as a doctest."""
    import doctest

    tests = doctest.DocTestFinder().find(gograph.make_graphed_callables, "make_graphed_callables", globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 5 and result.failed == 0
