"""The layer order of shared/design/ARCHITECTURE.md, enforced for every package and every import.

    core  <  models, graph_passes  <  train, export  <  runtime (and runtime.triton)  <  bench

A module imports only from its own package or a layer below it (lazy imports inside
functions included), never from another package's `__main__`; the torch-free modules
import no torch, checked in a fresh interpreter.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"core": 0, "models": 1, "graph_passes": 1, "train": 2, "export": 2, "runtime": 3, "bench": 4}
TORCH_FREE = ["core", "core.errors", "core.outputs", "core.contract", "core.inputs",
              "graph_passes", "graph_passes.__main__", "runtime.ort_session", "runtime.triton.python_model",
              "runtime.generate", "runtime.triton.repository"]


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
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
