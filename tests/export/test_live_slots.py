"""The portable graph attends over the live slots (issue 44): from a capacity of LIVE_CUT_FROM, each layer's
attention is an If on CUT_BELOW x L <= S_max (L = max(position) + T), whose branch cuts the caches and the mask to their
first L slots and whose other branch reads the whole cache; both give the logits of the graph without the cut.
The GroupQueryAttention graph keeps its own attention (it reads the written slots itself)."""
import numpy as np
import pytest

from core.contract import contract_of
from core.decode import Step
from export.conventions import run_onnx
from export.emit import CUT_BELOW, LIVE_CUT_FROM, emit_graph
from export.verify import ATOL, ort_session
from graph_passes.lazy import materialized
from models.weights import model_weights
from tests.helpers import random_model


def _ifs(proto) -> int:
    return sum(n.op_type == "If" for n in proto.graph.node)


def _logits(tmp_path, model, dtype, form, cut, steps) -> list[np.ndarray]:
    """The graph's logits over `steps` in ONNX Runtime; a bf16 graph (made bf16 as the build makes it) through
    its widened copy, as the build checks it (ONNX Runtime's CPU has no bf16 arithmetic)."""
    from core.onnx_writer import save_onnx
    from export.bfloat16 import bf16_graph, widened_copy
    e = emit_graph(model_weights(model), dtype, form, live_cut=cut)
    proto = bf16_graph(e.proto, e.lazy, e.fp32) if dtype == "bf16" else e.proto
    path = tmp_path / f"{dtype}-{form}-{cut}.onnx"
    save_onnx(materialized(proto, e.lazy), path)
    run = widened_copy(path) if dtype == "bf16" else path
    return _ifs(e.proto), [o["logits"] for o in run_onnx(ort_session(run), contract_of(run), steps, trim=1)]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("form", ["plain", "fused"])
def test_the_cut_graph_equals_the_whole_cache_graph_on_both_branches(tmp_path, dtype, form):
    """Two rows at different slots, a prefill (L = 305 of 1024: the cut branch) then steps that cross a third of
    the capacity (the whole cache): the same logits as the graph without the cut, at the dtype's
    tolerance; a grouped-query model with rope and a sliding window, so that both masks are cut."""
    model = random_model(seed=5, norm="rmsnorm", n_head=4, n_kv_head=2, pos_embedding="rope", max_seq_len=LIVE_CUT_FROM,
                         sliding_window=64, sliding_layers=[0])
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 700))
    steps = [Step(ids[:, :300], np.array([0, 5]))] + [Step(ids[:, t:t + 1], np.array([t, t + 5]))
                                                      for t in range(300, 700, 97)]
    live = [int(s.position.max()) + s.input_ids.shape[1] for s in steps]
    assert live[0] * CUT_BELOW <= LIVE_CUT_FROM < live[-1] * CUT_BELOW                  # both branches run
    cut_ifs, cut = _logits(tmp_path, model, dtype, form, True, steps)
    whole_ifs, whole = _logits(tmp_path, model, dtype, form, False, steps)
    assert (cut_ifs, whole_ifs) == (model.cfg.n_layer, 0)
    worst = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(cut, whole))
    assert worst <= ATOL["fp32" if dtype == "bf16" else dtype], worst      # bf16: both widened, fp32 arithmetic


def test_where_the_cut_is_made_by_default(tmp_path):
    """emit_graph cuts from LIVE_CUT_FROM slots, at every dtype; not below; the build's GroupQueryAttention
    graph never (export/graph_stages.py passes live_cut=False)."""
    from export.graph_stages import make_graph
    from export.report import BuildReport
    long, short = (random_model(seed=1, norm="rmsnorm", max_seq_len=n) for n in (LIVE_CUT_FROM, LIVE_CUT_FROM - 1))
    assert _ifs(emit_graph(model_weights(long), "fp32", "plain").proto) == long.cfg.n_layer
    assert _ifs(emit_graph(model_weights(long), "fp16", "fused").proto) == long.cfg.n_layer
    assert _ifs(emit_graph(model_weights(short), "fp32", "plain").proto) == 0
    assert _ifs(emit_graph(model_weights(long), "bf16", "plain").proto) == long.cfg.n_layer
    proto, _ = make_graph(model_weights(long), BuildReport("(in memory)", "(out)", "fp32", True), True, "fp32", "gqa")
    assert _ifs(proto) == 0 and any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_portable_build_at_a_long_capacity_verifies_its_cut_graph(tmp_path, dtype):
    """export.build --target portable of a 1024-slot checkpoint writes the If graph, verifies it against the
    torch reference as every build is verified, and its TensorRT lint finds nothing."""
    import json
    import onnx
    from export.build import main
    from tests.helpers import write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=2, norm="rmsnorm", max_seq_len=LIVE_CUT_FROM))
    out = tmp_path / "build"
    assert main(["--checkpoint", str(ckpt), "--fuse", "--target", "portable", "--dtype", dtype, "--out", str(out)]) == 0
    graph = onnx.load(str(out / "model.fused.onnx"), load_external_data=False)
    assert _ifs(graph) == 2
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == "portable" and report["max_abs_diff"]["graph_vs_torch"]
    assert report["trt_lint"] == []                 # TensorRT's parser takes an If that is no graph output
