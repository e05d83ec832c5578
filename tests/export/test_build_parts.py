"""export's build in parts: the options checked once, when made (export/options.py); the folds and the
quantization on one loaded graph (export/graph_stages.py), writing the graph that a load per stage wrote."""
from pathlib import Path

import pytest

from core.errors import UsageError
from export.options import BuildOptions
from export.quantize import QuantConfig
from export.target import Target

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"


def test_the_cli_checks_each_option_once(monkeypatch):
    import export.options as options
    calls = []
    for name in ("check_quantize", "check_genai", "check_attention", "check_kv_cache"):
        real = getattr(options, name)
        monkeypatch.setattr(options, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    BuildOptions.resolved(True, "fp32", QuantConfig("int4"), False, "fp32", resolve=lambda: Target("ort-cpu", "gqa"))
    assert calls == ["check_quantize", "check_genai", "check_attention", "check_kv_cache"]


def test_quantize_options_are_refused_before_the_target_is_resolved():
    """Resolving --target auto reads the model's config: a wrong --quantize option is the command line's fault
    (exit 2) whatever that config holds, so it is refused first."""
    resolved = []
    with pytest.raises(UsageError, match="--block-size 7"):
        BuildOptions.resolved(True, "fp32", QuantConfig("int4", block_size=7), False, "fp32",
                              resolve=lambda: resolved.append("target"))
    assert resolved == []


def test_an_options_object_is_a_checked_one():
    with pytest.raises(UsageError, match="--quantize int4: expected --fuse too"):
        BuildOptions(False, quantize=QuantConfig("int4"))
    with pytest.raises(UsageError, match="--kv-cache fp16: expected the ONNX Runtime CPU graph"):
        BuildOptions(True, kv_cache="fp16")
    o = BuildOptions(True, quantize=QuantConfig("int4"), attention="gqa")
    assert (o.graph_name, o.graph_kind, o.tolerance_key) == ("model.int4.onnx", "int4", "dequantized")
    assert BuildOptions(True, attention="gqa", kv_cache="fp16").tolerance_key == "fp16"


@pytest.mark.parametrize("kind, attention, dtype", [("internal-taper", "gqa", "int4"), ("gemma3", "gqa", "int4"),
                                                     ("qwen3", "plain", "int8")])
def test_the_folds_and_the_quantization_share_one_load_and_write_the_same_graph(monkeypatch, kind, attention, dtype):
    """One PassContext (one graphsurgeon import) for the fold passes, the leftover check and the quantize passes;
    the graph and its weights' recipes are those of a load per stage (run_passes, then quantize_weights on the
    saved folded graph), names and inferred shapes included (Gemma 3's QK-norms: the folds' merged heads)."""
    import graph_passes.base as base
    from export.emit import emit_graph
    from export.graph_stages import make_graph
    from export.quantize import quantize_weights
    from export.report import BuildReport
    from graph_passes import passes_for, run_passes
    from graph_passes.logits_from import with_logits_from
    from models.weights import open_weights
    source, cfg = open_weights(ZOO / kind), QuantConfig(dtype)
    loads = []
    real = base.PassContext.__init__
    monkeypatch.setattr(base.PassContext, "__init__", lambda self, *a, **k: (loads.append(1), real(self, *a, **k))[1])
    report = BuildReport("(zoo)", "(out)", "fp32", True, attention=attention)
    proto, lazy = make_graph(source, report, True, "fp32", attention, cfg)
    assert len(loads) == 1 and report.folded and report.quantized.summary.matmuls_quantized > 0
    emitted = emit_graph(source, "fp32", "fused" if attention == "gqa" else attention)
    fused, _ = run_passes(emitted.proto, passes_for(attention), emitted.lazy)
    twice, summary = quantize_weights(fused, cfg, emitted.lazy)
    if attention == "gqa":                  # the ONNX Runtime graph's last stage
        twice = with_logits_from(twice)
    assert proto.SerializeToString() == twice.SerializeToString()
    assert {k: w.key for k, w in lazy.items()} == {k: w.key for k, w in emitted.lazy.items()}
    assert report.quantized.summary.weight_bytes_before == summary.weight_bytes_before > 0


@pytest.mark.parametrize("attention, genai, capacity, dtype, why", [
    ("gqa", False, 4096, "int8", "auto: int8 (capacity 4096 >= 4096 tokens on ONNX Runtime's CPU graph"),
    ("gqa", False, 4095, "fp32", "auto: fp32 (capacity 4095 < 4096 tokens"),
    ("gqa", True, 8192, "fp32", "auto: fp32 (--genai"),
    ("plain", False, 8192, "fp32", "auto: fp32 (plain attention"),
    ("fused", False, 8192, "fp32", "auto: fp32 (fused attention")])
def test_kv_cache_auto_picks_int8_for_long_ort_cpu_caches(attention, genai, capacity, dtype, why):
    """--kv-cache auto (the default): int8 on ONNX Runtime's CPU graph from INT8_CACHE_FROM tokens of capacity,
    fp32 below, for the portable graph and for GenAI's folder; the capacity is read only when it decides; a dtype
    named on the command line is taken as it is, with no reason."""
    from export.options import INT8_CACHE_FROM
    read = []

    def capacity_of():
        read.append(capacity)
        return capacity
    o = BuildOptions.resolved(True, "fp32", None, genai, "auto", resolve=lambda: Target("x", attention),
                              capacity=capacity_of)
    assert INT8_CACHE_FROM == 4096 and (o.kv_cache, o.kv_cache_why[:len(why)]) == (dtype, why)
    assert read == ([capacity] if attention == "gqa" and not genai else [])
    named = BuildOptions.resolved(True, "fp32", None, False, "fp32", resolve=lambda: Target("x", "gqa"),
                                  capacity=capacity_of)
    assert (named.kv_cache, named.kv_cache_why) == ("fp32", "")
