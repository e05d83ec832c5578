import importlib
import sys
from pathlib import Path

# tests import their shared fixtures as `from tests.helpers import ...`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


# Test folders whose modules import graph_passes, and so onnx-graphsurgeon, when they are
# collected. A machine without it (the borrowed GPU machine has none) would stop at
# collection, even for `pytest -m gpu`; there these folders are not collected, and the run
# says so in its header and summary. tests/test_gpu_collection.py keeps this list true.
NEEDS_GRAPHSURGEON = ("graph_passes", "export")
NOT_COLLECTED = (f"not collected: tests/{', tests/'.join(NEEDS_GRAPHSURGEON)} (onnx-graphsurgeon is not importable; "
                 "pip install onnx-graphsurgeon)")
GRAPHSURGEON_MISSING = not _importable("onnx_graphsurgeon")
collect_ignore = list(NEEDS_GRAPHSURGEON) if GRAPHSURGEON_MISSING else []


def pytest_report_header(config):
    return [NOT_COLLECTED] if GRAPHSURGEON_MISSING else []


def pytest_terminal_summary(terminalreporter):
    if GRAPHSURGEON_MISSING:
        terminalreporter.write_line(NOT_COLLECTED)
