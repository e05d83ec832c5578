"""Scaled dot-product attention over the fixed-capacity cache, exportable as one ONNX op.

    attend(q [B, H, T, D], k [B, H_kv, S, D], v [B, H_kv, S, D], mask bool [B, 1, T, S],
           scale=None, softcap=None) -> [B, H, T, D]
        (H a multiple of H_kv: grouped-query attention)
        softmax(cap(q k^T * scale), masked where mask is False) v
        scale None: 1 / sqrt(D); cap(a) = softcap * tanh(a / softcap) (Gemma 2), the identity without it

Eager torch (training, the reference) always computes it with plain ops. When exporting,
the graph gets either those plain ops (MatMul, Mul, Where, Softmax, MatMul and the
Transpose of k: the portable form, which every runtime and TensorRT's parser read) or,
inside `fused_attention_export()`, one custom op that the torch export (tests/export/oracle.py, the test oracle) translates to
the opset-24 ONNX Attention op (ONNX Runtime's CPU provider runs it as one kernel). The
cache write (models/kv_cache.py, TensorScatter in place) is the same in both forms.
"""
from __future__ import annotations

import contextlib
import math

import torch

_FUSED = {"on": False}


def attend_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    b, h, t, d = q.shape
    group = h // k.shape[1]
    if group > 1:   # grouped-query attention: each kv head serves `group` query heads, read in place
        q, k, v, mask = q.view(b, k.shape[1], group, t, d), k[:, :, None], v[:, :, None], mask[:, None]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d) if scale is None else scale)   # [B, H(_kv, G), T, S]
    if softcap:         # before the mask, as transformers' Gemma 2 and ONNX Attention's softcap do
        att = torch.tanh(att / softcap) * softcap
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (att @ v).reshape(b, h, t, d)                                                    # [B, H, T, D]


@torch.library.custom_op("tapernorm::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float = 0.0, softcap: float = 0.0) -> torch.Tensor:
    """The fused form's op (exported only; tests/export/oracle.py maps it to ONNX Attention).
    scale 0: 1 / sqrt(D); softcap 0: none (ONNX Attention's own defaults)."""
    return attend_plain(q, k, v, mask, scale or None, softcap or None)


@attention_op.register_fake
def _(q, k, v, mask, scale=0.0, softcap=0.0):
    return torch.empty_like(q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    if _FUSED["on"] and torch.compiler.is_exporting():
        if scale is None and softcap is None:      # the op as every earlier graph has it: no attributes
            return torch.ops.tapernorm.attention(q, k, v, mask)
        return torch.ops.tapernorm.attention(q, k, v, mask, scale or 0.0, softcap or 0.0)
    return attend_plain(q, k, v, mask, scale, softcap)


@contextlib.contextmanager
def fused_attention_export():
    """Within: an export records attention as one tapernorm::attention op per layer."""
    before = _FUSED["on"]
    _FUSED["on"] = True
    try:
        yield
    finally:
        _FUSED["on"] = before
