"""The decode contract's I/O names are spelled once, in core/contract.py; every other module uses
its constants (INPUT_IDS, POSITION, cache_name, present_name, ...), so a rename is one edit.

A string literal (an f-string's literal parts included) that is a contract input name or starts
like a cache name counts; docstrings and comments, which describe, are whole texts and do not.
"""
import ast
from pathlib import Path

from tests.helpers import project_sources

ROOT = Path(__file__).resolve().parents[2]
HOME = "core/contract.py"
NAMES = ("input_ids", "position", "logits_from")   # exact literals
PREFIXES = ("key_", "value_", "present_")   # a literal starting with one of these
# (file, name or prefix): why that file spells it itself. Other conventions only.
ALLOWED = {
    ("export/conventions.py", "input_ids"): "Hugging Face's / ONNX Runtime GenAI's convention (HuggingFaceStyle)",
    ("bench/genai.py", "input_ids"): "ONNX Runtime GenAI's own graphs and API",
    ("export/genai.py", "input_ids"): "genai_config.json's names of GenAI's own inputs",
    ("export/genai.py", "present_"): "genai_config.json's keys (present_key_names, ...), GenAI's schema",
    ("bench/ort_kernels.py", "present_"): "a one-op GroupQueryAttention graph built in code, its own I/O names",
}


def _hits(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in docstrings:
            continue
        for name in NAMES:
            if node.value == name:
                yield node.lineno, name
        for prefix in PREFIXES:
            if node.value.startswith(prefix):
                yield node.lineno, prefix


def spellings(root: Path = ROOT) -> list[str]:
    """'path:line name' for every contract-name literal outside core/contract.py and the allow-list."""
    found = []
    for path, rel in project_sources(root):
        if rel == HOME:
            continue
        found += [f"{rel}:{line} {name!r}" for line, name in _hits(path) if (rel, name) not in ALLOWED]
    return found


def test_the_contract_names_are_spelled_in_core_contract_only():
    assert spellings() == [], "use core.contract's INPUT_IDS / POSITION / cache_name / present_name"


def test_core_contract_spells_every_name():
    assert {name for _, name in _hits(ROOT / HOME)} >= {"input_ids", "position", "key_", "present_"}


def test_the_check_catches_a_second_spelling(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "probe.py").write_text('"""input_ids, position: a docstring is fine."""\n'
                                                   'feeds = {"position": 0}\nout = f"present_{1}"\n')
    assert spellings(tmp_path) == ["runtime/probe.py:2 'position'", "runtime/probe.py:3 'present_'"]
