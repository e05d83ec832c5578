"""models/families.py: one record per model_type, the one registry every list of families reads.

Adding a family is one record plus its tests: these check that each record is the only one of its
model_type, that what the converter lists (SUPPORTED, HF_DEFAULTS, its refusal, the README's table)
is the registry, that each family has its tiny folder in tests/hf_models.py, and that the
converter's modules read the record, never branch on the model_type themselves.
"""
import ast
import re
from pathlib import Path

import pytest

import models.convert as convert
from models.families import FAMILIES, HF_DEFAULTS, RECORDS, SUPPORTED, Family, family_of, registry
from models.hf_files import ConvertError
from tests.hf_models import FAMILIES as TINY_FOLDERS

ROOT = Path(__file__).resolve().parents[2]
# the converter's modules besides the registry: they read a family's record, not its model_type
CONVERTER_MODULES = ("models/convert.py", "models/hf_config.py", "models/hf_fields.py", "models/hf_files.py",
                     "models/hf_layout.py", "models/hf_rope.py")


def test_every_family_has_exactly_one_record():
    types = [record.model_type for record in RECORDS]
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
    assert all(FAMILIES[t] is record for t, record in zip(types, RECORDS))


def test_the_registry_refuses_a_second_record_of_a_model_type():
    with pytest.raises(ValueError, match="two records of model_type 'llama'"):
        registry((*RECORDS, Family("llama", defaults={})))


def test_supported_is_the_registry():
    assert SUPPORTED == tuple(FAMILIES) == tuple(record.model_type for record in RECORDS)
    assert convert.SUPPORTED is SUPPORTED and convert.HF_DEFAULTS is HF_DEFAULTS
    assert all(HF_DEFAULTS[t] is FAMILIES[t].defaults for t in SUPPORTED) and tuple(HF_DEFAULTS) == SUPPORTED


def test_the_refusal_lists_the_registry():
    assert family_of("qwen2", "config.json") is FAMILIES["qwen2"]
    with pytest.raises(ConvertError) as e:
        family_of("bert", "config.json")
    assert str(e.value) == f"config.json: model_type 'bert' is not supported; supported: {', '.join(SUPPORTED)}"


def test_every_family_has_a_tiny_folder_in_the_tests():
    """tests/models/test_convert.py holds each family's conversion to transformers' forward on these."""
    assert {model_type for model_type, _ in TINY_FOLDERS.values()} == set(SUPPORTED)


def test_the_readme_table_lists_the_registry():
    """README's supported-families table (first column `model_type`): every family, each once."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("| `model_type` |", 1)[1].split("\n\n", 1)[0]
    listed = [name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert sorted(listed) == sorted(SUPPORTED), listed


def _model_type_literals(path: Path) -> list[str]:
    """Strings equal to a supported model_type in the code of `path` (docstrings left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [f"{path.name}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in SUPPORTED and id(node) not in docstrings]


@pytest.mark.parametrize("module", CONVERTER_MODULES)
def test_the_converter_reads_the_record_not_the_model_type(module):
    """A `f.kind == "gemma2"` branch outside models/families.py is a family in two places."""
    assert _model_type_literals(ROOT / module) == []


def test_the_model_type_check_catches_a_branch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""gpt2 in a docstring is fine."""\ndef f(kind):\n    return kind == "gemma2"\n')
    assert _model_type_literals(probe) == ["probe.py:3 'gemma2'"]
