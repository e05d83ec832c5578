"""A build's output is its progress and its results: the exporter's own loggers stay quiet even where
another library set the root logger to INFO (ONNX Runtime's quantizer and GenAI's builder do, on import:
bench.decode's build workers printed hundreds of onnxscript / onnx_ir lines)."""
import io
import logging

from tests.export.oracle import export_onnx
from tests.helpers import random_model


def test_exporter_logs_nothing_under_an_info_root_logger():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        export_onnx(random_model(n_layer=1), None)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert stream.getvalue() == ""
