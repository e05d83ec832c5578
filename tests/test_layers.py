"""The layer order of shared/design/ARCHITECTURE.md, enforced for every package and every import.

    core  <  models, graph_passes  <  train, export  <  runtime (and runtime.triton)  <  bench

A module imports only from its own package or a layer below it (lazy imports inside
functions included), never from another package's `__main__`; the torch-free modules
import no torch, checked in a fresh interpreter. No module uses another module's private
names (`from x import _y`, `x._y`, `obj._y` where _y is not defined in the module itself):
what two modules share is public and documented. Inside a package no import circle, module-level
or function-level: a circle held by a lazy import is one move away from an ImportError.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"core": 0, "models": 1, "graph_passes": 1, "train": 2, "export": 2, "runtime": 3, "bench": 4}
TORCH_FREE = ["core", "core.errors", "core.lifecycle", "core.outputs", "core.onnx_writer", "core.contract", "core.inputs",
              "graph_passes", "graph_passes.__main__", "runtime.ort_session", "runtime.process_memory",
              "runtime.triton.python_model", "runtime.generate", "runtime.triton.repository"]


def _imports(path: Path, typing_only: bool = True):
    """(line, module) of every import in the file; typing_only=False leaves out those under
    `if TYPE_CHECKING:` (never run, so they hold no circle; they still count for the layers)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for a in node.names:                      # `from pkg import __main__`
                yield node.lineno, f"{node.module}.{a.name}"


def _violations(root: Path = ROOT):
    found = []
    for pkg, layer in LAYERS.items():
        for path in sorted((root / pkg).rglob("*.py")):
            for line, mod in _imports(path):
                top = mod.split(".")[0]
                if top not in LAYERS:
                    continue
                where = f"{path.relative_to(root)}:{line} imports {mod}"
                if top != pkg and LAYERS[top] >= layer:
                    found.append(f"{where} ({pkg} is layer {layer}, {top} is layer {LAYERS[top]})")
                if mod.split(".")[-1] == "__main__" and top != pkg:
                    found.append(f"{where} (another package's __main__)")
    return found


def test_every_import_follows_the_layer_order():
    assert _violations() == []


def test_the_layer_table_covers_every_package():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(LAYERS), "add the new package to LAYERS (and to ARCHITECTURE.md)"


def test_the_check_itself_catches_a_breach(tmp_path):
    (tmp_path / "core").mkdir()         # a probe tree beside the source tree, never inside it
    (tmp_path / "core" / "_layer_probe.py").write_text("def f():\n    from runtime.session import DecoderSession\n")
    assert any("_layer_probe.py:2 imports runtime.session" in v for v in _violations(tmp_path))


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_do_not_import_torch(module):
    code = f"import sys, {module}; sys.exit(3 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"importing {module} imports torch" if r.returncode == 3 else r.stderr


# Circles not yet opened, each with the issue that removes it: none (issue 43 opened the last three).
ALLOWED_CIRCLES: list[set[str]] = []


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of its own package it imports, at module level or inside a function."""
    paths = {_module_name(root, p): p for pkg in LAYERS for p in sorted((root / pkg).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        pkg = name.split(".")[0]
        graph[name] = {mod for _, mod in _imports(path, typing_only=False)
                       if mod in paths and mod != name and mod.split(".")[0] == pkg}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_circle_inside_a_package():
    circles = [sorted(c) for c in _circles(_import_graph()) if c not in ALLOWED_CIRCLES]
    assert circles == [], "move what both modules need into one of them, or below both"


def test_every_allowed_circle_is_still_there():
    """An entry whose circle is gone is stale: remove it (the list must not hide a new circle there)."""
    found = _circles(_import_graph())
    assert [sorted(c) for c in ALLOWED_CIRCLES if c not in found] == []


def test_the_circle_check_catches_a_lazy_circle(tmp_path):
    (tmp_path / "core").mkdir()         # a probe tree beside the source tree, never inside it
    (tmp_path / "core" / "a.py").write_text("from core.b import y\nx = 1\n")
    (tmp_path / "core" / "b.py").write_text("def y():\n    from core.c import z\n    return z\n")
    (tmp_path / "core" / "c.py").write_text("def z():\n    import core.a\n    return core.a.x\n")
    (tmp_path / "core" / "d.py").write_text("import core.a\n")
    assert _circles(_import_graph(tmp_path)) == [{"core.a", "core.b", "core.c"}]


def test_an_annotation_only_import_holds_no_circle(tmp_path):
    """`if TYPE_CHECKING:` imports never run: a back-reference for a type hint is no circle."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text("from core.b import y\n")
    (tmp_path / "core" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from core.a import X\ny = 1\n")
    assert _circles(_import_graph(tmp_path)) == []
    (tmp_path / "core" / "b.py").write_text("from core.a import X\ny = 1\n")
    assert _circles(_import_graph(tmp_path)) == [{"core.a", "core.b"}]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: Path):
    """(line, what) for each private name of another module this module uses."""
    tree = ast.parse(path.read_text(), str(path))
    own, foreign = set(), set()       # names this module defines; names bound to modules of other libraries
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
            own.add(n.attr)
        elif isinstance(n, ast.Import):
            foreign |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name.split(".")[0] not in LAYERS}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in LAYERS:
            yield from ((n.lineno, f"from {n.module} import {a.name}") for a in n.names if _private(a.name))
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and _private(n.attr) \
                and n.attr not in own and not (isinstance(n.value, ast.Name) and n.value.id in foreign):
            yield n.lineno, f"{ast.unparse(n.value)}.{n.attr}"


def _private_violations(root: Path = ROOT):
    return [f"{path.relative_to(root)}:{line} uses {what}" for pkg in LAYERS
            for path in sorted((root / pkg).rglob("*.py")) for line, what in _private_uses(path)]


def test_no_module_uses_another_modules_private_names():
    assert _private_violations() == [], "make the name public (and document it) where it is defined"


def test_the_private_check_catches_each_form(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "probe.py").write_text(
        "import os\nfrom core.contract import _dim\nimport core.contract as c\n"
        "def f(ctx):\n    os._exit(0)\n    return c._dim(1), ctx._scopes, f._own\nf._own = 1\n")
    assert sorted(_private_violations(tmp_path)) == ["core/probe.py:2 uses from core.contract import _dim",
                                                     "core/probe.py:6 uses c._dim", "core/probe.py:6 uses ctx._scopes"]
