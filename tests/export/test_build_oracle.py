"""export.build's graph against torch's own export of the same checkpoint (tests/export/oracle.py).

The one route (export/pipeline.py) emits the graph from the model's spec, and the graph passes fold (and
quantize) each weight when it is written, reading the checkpoint tensor by tensor. On small models its
graph must be the one torch's exporter gives for the same checkpoint loaded whole, through the same passes
(and quantize_weights in memory): the same computing ops (counted), and the same outputs within fp32's
tolerance; within the quantized dtype's for int4 / int8 (a weight one ulp apart can round to the next level);
for fp16 within twice fp16's tolerance (each graph folds fp16 weights, in another order: each is within fp16's
tolerance of the truth). The build's own verification (every logit and written cache slot against the torch
reference run block by block) must pass too. (tests/export/test_emit.py holds the emitted graph alone to the
oracle on every model the decoder can be; this is the whole build, from the checkpoint's files.)
"""
from collections import Counter
from pathlib import Path

import onnx
import pytest

from export.quantize import QuantConfig
from tests.hf_models import hf_model, save_hf

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"
# the ops that compute (not views, shapes or masks); both graphs have as many of each
COMPUTING = ("MatMul", "MatMulNBits", "GatherBlockQuantized", "Gemm", "Add", "Sub", "Mul", "Div", "Tanh", "Gelu",
             "Relu", "Sigmoid", "Softmax", "RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization",
             "Attention", "GroupQueryAttention", "TensorScatter", "Gather", "Sum", "Cos", "Sin")


def _folder(source: str, tmp_path: Path) -> Path:
    kind, name = source.split(":")
    if kind == "zoo":
        return ZOO / name
    # ONNX Runtime's GroupQueryAttention rotates heads of a multiple of 16: the tiny Llama's 8 doubled
    return save_hf(hf_model(name, **(dict(hidden_size=64) if name == "llama" else {})), tmp_path / name)


def _model(folder: Path):
    """The checkpoint loaded whole, by the loaders the build does not use (it reads tensor by tensor)."""
    from models.checkpoint import load_checkpoint
    from models.convert import convert, is_hf_folder
    return convert(folder).model if is_hf_folder(folder) else load_checkpoint(folder)


def _oracle_graph(folder: Path, attention: str, quantize, dtype: str) -> onnx.ModelProto:
    """torch.onnx.export of the model, the same passes, [quantize_weights]: what the build's graph must compute."""
    from graph_passes import passes_for, run_passes
    from tests.export.oracle import export_onnx
    proto = export_onnx(_model(folder), None, dtype, attention="fused" if attention == "gqa" else attention)
    proto, _ = run_passes(proto, passes_for(attention))
    if quantize is not None:
        from export.quantize import quantize_weights
        proto, _ = quantize_weights(proto, quantize)
    if attention == "gqa":                  # the ONNX Runtime graph's last stage (export/graph_stages.py)
        from graph_passes.logits_from import with_logits_from
        proto = with_logits_from(proto)
    return proto


def _computing(proto) -> Counter:
    return Counter(n.op_type for n in proto.graph.node if n.op_type in COMPUTING)


CASES = [
    # (source, attention, quantize, dtype): the default run has the whole route's other arithmetic (int4 blocks
    # written lazily, fp16 cast after the fold); every norm kind's fold and the families in the slow run
    ("hf:llama", "gqa", QuantConfig("int4"), "fp32"),             # rope, GQA cache, packed Q/K/V, int4
    ("hf:qwen2", "plain", None, "fp16"),                          # q/k/v biases, fp16 weights cast when written
    pytest.param("zoo:internal-taper", "plain", None, "fp32", marks=pytest.mark.slow),
    pytest.param("zoo:dyt", "gqa", None, "fp32", marks=pytest.mark.slow),
    pytest.param("hf:gpt2-fakeln", "plain", None, "fp32", marks=pytest.mark.slow),    # disabled norms folded whole
    pytest.param("hf:gpt2", "plain", QuantConfig("int8"), "fp32", marks=pytest.mark.slow),  # LayerNorm, Conv1D, int8
    pytest.param("zoo:all-taper", "plain", None, "fp32", marks=pytest.mark.slow),
    pytest.param("zoo:baseline", "plain", QuantConfig("int8"), "fp32", marks=pytest.mark.slow),
    pytest.param("zoo:gpt2-all-taperln", "gqa", QuantConfig("int4", head="int8"), "fp32", marks=pytest.mark.slow),
    pytest.param("zoo:gpt2-fakeln", "plain", None, "fp32", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("source,attention,quantize,dtype", CASES)
def test_the_built_graph_equals_torchs_export_through_the_same_passes(tmp_path, source, attention, quantize, dtype):
    from export.options import BuildOptions
    from export.pipeline import build
    from export.verify import ATOL, verify_pair
    folder = _folder(source, tmp_path)
    lines = []
    report = build(folder, tmp_path / "out", BuildOptions(True, dtype, quantize=quantize, attention=attention),
                   log=lines.append)
    assert lines[0].startswith("[1/5] open") and any("block 1/" in line for line in lines)    # progress per block
    path = tmp_path / "out" / report.graph
    assert report.graph == (quantize.file_name() if quantize else "model.fused.onnx") and path.is_file()
    reference = _oracle_graph(folder, attention, quantize, dtype)
    built = onnx.load(str(path))
    assert _computing(built) == _computing(reference)
    onnx.save(reference, str(tmp_path / "reference.onnx"))
    # fp32: its tolerance; quantized: its dtype's (export.verify reads it off the graphs); fp16: two graphs each
    # within fp16's tolerance of the truth are within twice that of each other (logits here ~5: 2 x (0.01 + 0.004 x 5))
    atol = {"fp32": ATOL["fp32"], "fp16": 0.06}[dtype] if not quantize else None
    results = verify_pair(tmp_path / "reference.onnx", path, atol=atol)
    assert results and all(c.max_abs_diff for c in results)
    per = report.verification.graph_vs_torch
    assert per and max(v for d in per.values() for v in d.values()) > 0     # the build's own check ran (it raises)
