"""The files of a build folder (what export.build writes), named once for every reader: export writes
them, runtime and the Triton repository pick a graph among them, bench.scale times one.

    model.onnx          the export, norms as they were trained
    model.fused.onnx    the folded graph (graph_passes): what TensorRT and a float ONNX Runtime run
    model.int4.onnx     a --quantize build's graph (ONNX Runtime's MatMulNBits): what ONNX Runtime runs
    model.int8.onnx     first from a folder (runtime/model_files.py)
    tokenizer.json      the checkpoint's tokenizer, copied
    report.json         what the build did and measured
"""
from __future__ import annotations

UNFUSED = "model.onnx"
FUSED = "model.fused.onnx"
TOKENIZER = "tokenizer.json"
REPORT = "report.json"


def quantized_name(dtype: str) -> str:
    """The graph a --quantize DTYPE build writes."""
    return f"model.{dtype}.onnx"


QUANTIZED = (quantized_name("int4"), quantized_name("int8"))
