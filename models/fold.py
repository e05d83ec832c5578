"""The torch-side fold: a Decoder copy whose norm scales (gamma / beta, TaperNorm's c * gamma_tilde
and beta_tilde, DyT's gamma / beta) live in the linears they feed.

    norm(x) = core(x) * scale + shift,   linear(norm(x)) = linear'(core(x))
    W' = W diag(scale),  b' = b + W shift

what stays of each norm is its scale-free core: x / rms(x) (ScalelessRMSNorm), the plain
LayerNorm (ScalelessLayerNorm), tanh(alpha x) (DyTCore), nothing for TaperNorm at g = 0.
This is the same algebra graph_passes applies to the exported ONNX graph (FlashNorm for the
RMSNorm gamma); here it gives the eager torch model the fold (bench.decode's torch variants).
A tied head is untied (cloned) when the final norm folds into it: the embedding must stay
unscaled. tests/models/test_fold.py checks the logits before and after.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import Decoder
from models.norms import DyT, LayerNorm, RMSNorm, TaperNorm


class ScalelessRMSNorm(nn.Module):
    """x / rms(x) with gamma already folded into the next linear (FlashNorm)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), None, self.eps)


class ScalelessLayerNorm(nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), None, None, self.eps)


class DyTCore(nn.Module):
    """tanh(alpha x): DyT with gamma and beta folded into the next linear."""

    def __init__(self, alpha: torch.Tensor):
        super().__init__()
        self.alpha = nn.Parameter(alpha.detach().clone())

    def forward(self, x):
        return torch.tanh(self.alpha * x)



def _split_norm(norm: nn.Module):
    """(scale [d] or None, shift [d] or None, what stays in the graph) for a norm module."""
    if isinstance(norm, RMSNorm):
        return norm.weight, None, ScalelessRMSNorm(norm.eps)
    if isinstance(norm, LayerNorm):
        return norm.weight, norm.bias, ScalelessLayerNorm(norm.eps)
    if isinstance(norm, DyT):
        return norm.weight, norm.bias, DyTCore(norm.alpha)
    if isinstance(norm, TaperNorm):
        if norm.gate.value != 0.0:
            raise ValueError(f"TaperNorm gate {norm.gate.value:g}; folding needs gate 0")
        return norm.c * norm.weight_tilde, norm.bias_tilde, nn.Identity()
    return None, None, norm


@torch.no_grad()
def _fold_into(linear: nn.Linear, scale, shift) -> None:
    """linear(x * scale + shift) == linear'(x): W' = W diag(scale), b' = b + W shift."""
    w = linear.weight                                   # [out, in]
    if shift is not None:
        extra = w @ shift.detach()
        if linear.bias is None:
            linear.bias = nn.Parameter(extra.clone())
        else:
            linear.bias.add_(extra)
    if scale is not None:
        w.mul_(scale.detach()[None, :])


@torch.no_grad()
def fold_norms(model: Decoder) -> Decoder:
    """A copy with every norm's affine part (gamma/beta, c*gamma_tilde/beta_tilde) folded into
    the linears it feeds; the tied head is untied (cloned) when the final norm folds into it."""
    model = copy.deepcopy(model)
    targets = []
    for block in model.blocks:
        mlp_in = [block.mlp.up_proj] + ([block.mlp.gate_proj] if hasattr(block.mlp, "gate_proj") else [])
        targets += [(block, "ln_1", [block.attn.q_proj, block.attn.k_proj, block.attn.v_proj]),
                    (block, "ln_2", mlp_in)]
    if not isinstance(model.ln_f, nn.Identity):
        if model.lm_head.weight is model.wte.weight:
            model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
        targets.append((model, "ln_f", [model.lm_head]))
    for parent, attr, linears in targets:
        scale, shift, core = _split_norm(getattr(parent, attr))
        for lin in linears:
            _fold_into(lin, scale, shift)
        setattr(parent, attr, core)
    return model.eval()


FOLDED_NORM_CLASSES = (ScalelessRMSNorm, ScalelessLayerNorm, DyTCore)
