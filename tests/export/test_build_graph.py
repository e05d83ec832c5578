"""export.pipeline.build_graph: build()'s graph stages over a model in memory (models.weights.model_weights;
what bench builds through), each graph verified as build() verifies it (a wrong weight fails); a quantized
graph's top-1 floor enforced for a trained model checked against the float model (--algo hqq), reported in a
note for random weights, whose agreement says nothing about the graph, and for a graph checked against its
own dequantized weights (rtn: exact, so its quality is the model's and the dtype's)."""
import onnx
import pytest

from export.pipeline import build_graph
from export.quantize import QuantConfig
from models.weights import model_weights
from tests.helpers import random_model


@pytest.fixture(scope="module")
def source():
    return model_weights(random_model(seed=0, norm="rmsnorm"))


def test_a_graph_of_a_model_in_memory_is_verified_like_builds(source, tmp_path):
    path = tmp_path / "model.fused.onnx"
    report = build_graph(source, path, fuse=True)
    per = report.verification.graph_vs_torch                     # verified like build()
    assert per and 0 < max(v for d in per.values() for v in d.values()) <= report.verification.atol
    assert report.source == "in-memory" and report.weight_bytes > 0
    assert set(report.op_counts) == {"emitted", "fused"} and report.norm_ops == {"emitted": 5, "fused": 5}
    assert [(f.pass_name, f.layer) for f in report.folded] == [                     # gains into W (ln_f: tied head)
        ("norm_gamma", f"blocks.{i}.{n}") for i in (0, 1) for n in ("ln_1", "ln_2")]
    assert {n.op_type for n in onnx.load(str(path)).graph.node} >= {"MatMul", "RMSNormalization", "TensorScatter"}
    unverified = build_graph(source, tmp_path / "unverified.onnx", fuse=True, verify=False)
    assert unverified.verification.graph_vs_torch == {} and unverified.op_counts == report.op_counts


def test_a_wrong_weight_fails_its_verification(source, tmp_path, monkeypatch):
    """One matrix written with its sign flipped (as a wrong fold would)."""
    import graph_passes.lazy as lazy
    from export.verify import VerificationError
    raw_bytes = lazy.raw_bytes

    def flipped(w, value):
        return raw_bytes(w, -value if w.key[0] == "blocks.1.mlp.down_proj.weight" else value)
    monkeypatch.setattr(lazy, "raw_bytes", flipped)
    with pytest.raises(VerificationError, match=r"model.fused.onnx vs torch\):\n- .*logits: max abs diff"):
        build_graph(source, tmp_path / "model.fused.onnx", fuse=True)


@pytest.mark.parametrize("algo, trained", [("hqq", True), ("hqq", False), ("rtn", True)])
def test_the_top1_floor_is_enforced_for_trained_models_checked_against_the_float_model(source, tmp_path, monkeypatch,
                                                                                       algo, trained):
    import export.quantize as quantize
    from export.verify import VerificationError
    monkeypatch.setitem(quantize.MIN_TOP1, "int4", 1.01)            # a floor no graph meets
    path, cfg = tmp_path / "model.int4.onnx", QuantConfig("int4", algo=algo)
    if algo == "hqq" and trained:
        with pytest.raises(VerificationError, match="top-1 agreement"):
            build_graph(source, path, fuse=True, quantize=cfg, trained=trained)
        return
    report = build_graph(source, path, fuse=True, quantize=cfg, trained=trained)
    floor = [n for n in report.notes if "top-1 agreement" in n]
    assert len(floor) == 1 and ("not enforced" in floor[0]) == (not trained), report.notes
    assert report.quantized.drift.teacher_forced_top1 < 1.01
    checked = report.quantized.tolerance.checked_against
    assert checked == ("dequantized weights" if algo == "rtn" else "float model")
    assert report.verification.graph_vs_torch                    # its outputs were compared all the same
