"""Fused attention (models/attention.py, export_onnx(attention="fused")): one opset-24 Attention op
per layer instead of MatMul/Mul/Where/Softmax/MatMul, equal to the plain graph and to torch,
with the cache still written in place by TensorScatter."""
import numpy as np
import torch

from tests.export.oracle import export_onnx
from export.verify import ort_session, read_interface, run_onnx, session_steps, verify_pair, compare
from tests.export.oracle import run_torch
from graph_passes import run_passes
from models.attention import attend, attend_plain
from tests.export.exported import _DIR, exported
from tests.helpers import random_model


def test_attention_op_equals_the_plain_ops():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    mask = (torch.arange(16)[None, None, :] <= (torch.tensor([0, 5])[:, None] + torch.arange(3))[:, :, None])[:, None]
    ref = attend_plain(q, k, v, mask)
    torch.testing.assert_close(torch.ops.tapernorm.attention(q, k, v, mask), ref)
    torch.testing.assert_close(attend(q, k, v, mask), ref)                  # eager: always the plain ops


def test_fused_attention_graph_equals_plain_and_torch():
    model, _, plain, _ = exported("internal-taper")
    fused = run_passes(export_onnx(model, _DIR / "internal-taper.attention.onnx", attention="fused"))[0]
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("Attention") == model.cfg.n_layer and "Softmax" not in ops and "Where" not in ops
    assert ops.count("TensorScatter") == 2 * model.cfg.n_layer
    assert ops.count("Transpose") < [n.op_type for n in plain.graph.node].count("Transpose")
    assert not [n for n in fused.graph.node if n.op_type == "Attention" and len(n.output) != 1]  # no present copies
    verify_pair(plain, fused, tokens=list(range(3, 40)))                     # fp32 atol 1e-4, ragged positions
    iface = read_interface(fused)
    steps = session_steps(iface, seed=4)
    compare(run_torch(model, iface, steps), run_onnx(ort_session(fused), iface, steps), "fp32", "fused vs torch")


def test_fused_attention_keeps_the_cache_in_place(tmp_path):
    from runtime.ort_session import OrtSession
    model = random_model(seed=2, norm="rmsnorm")
    path = tmp_path / "m.onnx"
    export_onnx(model, path, attention="fused")
    with OrtSession(path) as s:
        s.reset(2)
        ptrs = s.cache_ptrs()
        s.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
        s.decode_step(np.array([7, 8]), np.array([3, 3]))
        assert s.cache_ptrs() == ptrs
        assert np.abs(s.cache_array("key_0")[:, :, 3]).sum() > 0           # the step's key written in place


def test_fused_attention_with_grouped_query_heads_and_rope(tmp_path):
    """Llama-family models (issue 11: n_kv_head < n_head, rotary positions) through the fused op:
    the opset-24 Attention op reads the H_kv-head cache as ONNX's grouped-query attention."""
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    mask = (torch.arange(16)[None, None, :] <= (torch.tensor([0, 5])[:, None] + torch.arange(3))[:, :, None])[:, None]
    repeated = attend_plain(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), mask)
    torch.testing.assert_close(attend_plain(q, k, v, mask), repeated)       # grouping == repeating kv heads
    model = random_model(seed=3, norm="rmsnorm", n_head=4, n_kv_head=2, pos_embedding="rope")
    fused = export_onnx(model, tmp_path / "fused.onnx", attention="fused")
    assert [n.op_type for n in fused.graph.node].count("Attention") == model.cfg.n_layer
    iface = read_interface(fused)
    steps = session_steps(iface, seed=5)
    compare(run_torch(model, iface, steps), run_onnx(ort_session(fused), iface, steps), "fp32", "fused vs torch")
