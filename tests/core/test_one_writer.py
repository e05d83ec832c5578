"""One ONNX writer and one atomic file writer: every graph the project writes goes through
core/onnx_writer.py (one external-data rule), every file or directory swapped into place through
core/outputs.py, so a change to either rule is one edit. A call found elsewhere fails with its place."""
import ast
from pathlib import Path

from tests.helpers import project_sources

ROOT = Path(__file__).resolve().parents[2]
# (module, function) -> the one file allowed to call it
HOMES = {("onnx", "save"): "core/onnx_writer.py", ("onnx", "save_model"): "core/onnx_writer.py",
         ("os", "replace"): "core/outputs.py", ("os", "rename"): "core/outputs.py"}


def calls_outside_their_home(root: Path = ROOT) -> list[str]:
    found = []
    for path, rel in project_sources(root):
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                home = HOMES.get((f.value.id, f.attr))
                if home is not None and rel != home:
                    found.append(f"{rel}:{node.lineno} {f.value.id}.{f.attr} (belongs in {home})")
    return found


def test_graphs_and_atomic_files_have_one_writer_each():
    assert calls_outside_their_home() == []


def test_the_check_finds_a_stray_writer(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("import onnx, os\nonnx.save(p, 'x.onnx')\nos.replace('a', 'b')\n")
    assert calls_outside_their_home(tmp_path) == ["pkg/m.py:2 onnx.save (belongs in core/onnx_writer.py)",
                                                  "pkg/m.py:3 os.replace (belongs in core/outputs.py)"]
