"""export/kv_int8.py: a written GroupQueryAttention graph's caches made int8 in place, calibrated on the graph
itself and checked against it; refused in one line when the drift passes its bound."""
import numpy as np
import onnx
import pytest

from graph_passes import run_passes
from tests.export.oracle import export_onnx
from tests.helpers import random_model


def _gqa_file(tmp_path, capacity=80):
    model = random_model(seed=7, norm="rmsnorm", pos_embedding="rope", n_kv_head=2, mlp="swiglu", d_model=64, n_head=4,
                         max_seq_len=capacity)
    gqa = run_passes(run_passes(export_onnx(model, None, attention="fused"))[0], ["ort_gqa"])[0]
    path = tmp_path / "model.fused.onnx"
    onnx.save_model(gqa, str(path))
    return path


def test_check_tokens_without_a_tokenizer_are_seeded_random_ids_that_leave_the_steps_room():
    from export.kv_int8 import CHECK_STEPS, RANDOM_TOKENS, check_tokens
    ids, text = check_tokens(None, 100, 4096)
    assert len(ids) == RANDOM_TOKENS and text == f"random ids ({RANDOM_TOKENS})" and max(ids) < 100
    assert check_tokens(None, 100, 4096)[0] == ids                   # the same ids every build
    ids, _ = check_tokens(None, 100, 50)
    assert len(ids) == 50 - CHECK_STEPS - 1


def test_int8_cache_rewrites_the_graph_in_place_and_reports_its_drift(tmp_path):
    from core.contract import contract_of
    from export.kv_int8 import int8_cache
    from graph_passes.ort_attention import KV_CACHE_DRIFT
    from tests.graph_passes.test_ort_attention import _int8_cache_scales
    path = _gqa_file(tmp_path)
    lines = []
    result = int8_cache(path, None, lines.append)
    assert contract_of(path).dtype == "int8" and len(_int8_cache_scales(onnx.load(str(path)))) == 2 * 2
    assert 0 < result.drift <= KV_CACHE_DRIFT["int8"] and 0 <= result.agreement <= 1
    assert result.text == "random ids (47)" and result.calibration_tokens == 23
    assert lines == ["      " + result.line()] and "int8 KV cache vs fp32 cache max |d logits|" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.fused.onnx"]     # the proto alone rewritten


def test_int8_cache_past_its_bound_is_refused_in_one_line(tmp_path, monkeypatch):
    import graph_passes.ort_attention as att
    from export.kv_int8 import int8_cache
    from export.options import BuildError
    monkeypatch.setitem(att.KV_CACHE_DRIFT, "int8", 1e-9)
    with pytest.raises(BuildError) as e:
        int8_cache(_gqa_file(tmp_path), None)
    assert str(e.value).startswith("--kv-cache int8: expected the int8 cache to keep the logits within 0% of max "
                                   "|logits| of the fp32 cache's, found ") and "\n" not in str(e.value)


def test_int8_cache_needs_room_for_its_check(tmp_path):
    from export.kv_int8 import int8_cache
    from export.options import BuildError
    path = _gqa_file(tmp_path, capacity=16)
    with pytest.raises(BuildError, match="expected a capacity of at least 35 tokens .*; raise --max-seq-len"):
        int8_cache(path, None)
    assert onnx.load(str(path)).graph.input[2].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
