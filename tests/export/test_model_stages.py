"""export.pipeline.ModelStages: build()'s stages over a model in memory (what bench builds through),
each graph verified as build() verifies it; a quantized graph's top-1 floor enforced for a trained
model and reported (a note) for random weights, whose agreement says nothing about the graph."""
import pytest

from export.pipeline import ModelStages
from export.quantize import QuantConfig
from tests.helpers import random_model


@pytest.fixture(scope="module")
def fused():
    stages = ModelStages(random_model(seed=0, norm="rmsnorm"), None, "plain", verify=True)
    graph = stages.fuse(stages.export().proto)
    assert graph.report.max_abs_diff["fused_vs_torch"]              # verified like build()
    return graph.proto


@pytest.mark.parametrize("trained", [True, False])
def test_the_top1_floor_is_enforced_for_trained_models_only(fused, tmp_path, monkeypatch, trained):
    import export.quantize as quantize
    from export.verify import VerificationError
    monkeypatch.setitem(quantize.MIN_TOP1, "int4", 1.01)            # a floor no graph meets
    stages = ModelStages(random_model(seed=0, norm="rmsnorm"), None, "plain", verify=True, trained=trained)
    if trained:
        with pytest.raises(VerificationError, match="top-1 agreement"):
            stages.quantize(fused, QuantConfig("int4"), tmp_path / "model.int4.onnx")
    else:
        graph = stages.quantize(fused, QuantConfig("int4"), tmp_path / "model.int4.onnx")
        assert any("not enforced" in n for n in graph.report.notes)
        assert graph.report.quantized["drift"]["top1_agreement"] < 1.01
