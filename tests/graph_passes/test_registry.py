"""Registry coverage (optimum's test_all_models_tested): every pass and norm kind has a test."""
import importlib
import subprocess
import sys
from pathlib import Path

from graph_passes.registry import DEFAULT_PASSES, NORM_KIND_PASSES, PASSES
from models.norms import NORM_KINDS

HERE = Path(__file__).parent


def test_every_registered_pass_has_a_test_file():
    for name, cls in PASSES.items():
        module = cls.__module__.rsplit(".", 1)[-1]
        assert (HERE / f"test_{module}.py").is_file(), f"pass {name} ({cls.__module__}) has no tests/graph_passes/test_{module}.py"


def test_every_pass_draws_its_pattern_and_has_a_summary():
    for name, cls in PASSES.items():
        src = Path(importlib.import_module(cls.__module__).__file__).read_text()
        assert "# Pattern" in src, f"{name}: draw the pattern above the matcher"
        assert cls.summary and cls.name == name


def test_every_norm_kind_maps_to_a_registered_default_pass():
    assert set(NORM_KIND_PASSES) == set(NORM_KINDS)
    assert all(p in PASSES and p in DEFAULT_PASSES for p in NORM_KIND_PASSES.values())


def test_graph_passes_do_not_import_torch():
    code = "import sys, graph_passes, graph_passes.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
