"""Scaled dot-product attention over the fixed-capacity cache, exportable as one ONNX op.

    attend(q [B, H, T, D], k [B, H_kv, S, D], v [B, H_kv, S, D], mask bool [B, 1, T, S]) -> [B, H, T, D]
        (H a multiple of H_kv: grouped-query attention)
        softmax(q k^T / sqrt(D), masked where mask is False) v

Eager torch (training, the reference) always computes it with plain ops. When exporting,
the graph gets either those plain ops (MatMul, Mul, Where, Softmax, MatMul and the
Transpose of k: the portable form, which every runtime and TensorRT's parser read) or,
inside `fused_attention_export()`, one custom op that export/onnx_export.py translates to
the opset-24 ONNX Attention op (ONNX Runtime's CPU provider runs it as one kernel). The
cache write (models/kv_cache.py, TensorScatter in place) is the same in both forms.
"""
from __future__ import annotations

import contextlib
import math

import torch

_FUSED = {"on": False}


def attend_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b, h, t, d = q.shape
    group = h // k.shape[1]
    if group > 1:   # grouped-query attention: each kv head serves `group` query heads, read in place
        q, k, v, mask = q.view(b, k.shape[1], group, t, d), k[:, :, None], v[:, :, None], mask[:, None]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))            # [B, H, T, S] or [B, H_kv, G, T, S]
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (att @ v).reshape(b, h, t, d)                                                    # [B, H, T, D]


@torch.library.custom_op("tapernorm::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fused form's op (exported only; export/onnx_export.py maps it to ONNX Attention)."""
    return attend_plain(q, k, v, mask)


@attention_op.register_fake
def _(q, k, v, mask):
    return torch.empty_like(q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if _FUSED["on"] and torch.compiler.is_exporting():
        return torch.ops.tapernorm.attention(q, k, v, mask)
    return attend_plain(q, k, v, mask)


@contextlib.contextmanager
def fused_attention_export():
    """Within: an export records attention as one tapernorm::attention op per layer."""
    before = _FUSED["on"]
    _FUSED["on"] = True
    try:
        yield
    finally:
        _FUSED["on"] = before
