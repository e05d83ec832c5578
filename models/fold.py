"""The torch-side fold: a Decoder copy whose norm scales (gamma / beta, TaperNorm's c * gamma_tilde
and beta_tilde, DyT's gamma / beta) live in the linears they feed.

    norm(x) = core(x) * scale + shift,   linear(norm(x)) = linear'(core(x))
    W' = W diag(scale),  b' = b + W shift

what stays of each norm is its scale-free core: x / rms(x) (ScalelessRMSNorm), the plain
LayerNorm (ScalelessLayerNorm), tanh(alpha x) (DyTCore), nothing for TaperNorm at g = 0.
A norm that no matrix follows (a QK-norm before the rotary embedding, a post-sublayer norm before
the residual add) folds only as a TaperNorm at g = 0, into the output rows of the matrix before it
(W' = diag(S) W, b' = S b + B, S and B repeated over the heads); a live one stays whole, as the
graph passes leave it (graph_passes/output_fold.py).
This is the same algebra graph_passes applies to the exported ONNX graph (FlashNorm for the
RMSNorm gamma); here it gives the eager torch model the fold (bench.decode's torch variants).
A tied head is untied (cloned) when the final norm folds into it: the embedding must stay
unscaled. tests/models/test_fold.py checks the logits before and after.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import Decoder
from models.disabled_norm import DISABLED_NORM_EPS
from models.norms import DyT, LayerNorm, RMSNorm, TaperNorm


class ScalelessRMSNorm(nn.Module):
    """x / rms(x) with gamma already folded into the next linear (FlashNorm)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        # an explicit unit gamma (not None): the export then carries it as an initializer, as the
        # norm_gamma graph pass leaves it
        self.register_buffer("ones", torch.ones(d), persistent=False)

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.ones, self.eps)


class ScalelessLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("ones", torch.ones(d), persistent=False)
        self.register_buffer("zeros", torch.zeros(d), persistent=False)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.ones, self.zeros, self.eps)


class DyTCore(nn.Module):
    """tanh(alpha x): DyT with gamma and beta folded into the next linear."""

    def __init__(self, alpha: torch.Tensor):
        super().__init__()
        self.alpha = nn.Parameter(alpha.detach().clone())

    def forward(self, x):
        return torch.tanh(self.alpha * x)



@dataclass
class NormSplit:
    """A norm as core(x) * scale + shift; `center`: core is x - mean(x), folded into the weight too."""
    scale: torch.Tensor | None
    shift: torch.Tensor | None
    core: nn.Module
    center: bool = False


def _split_norm(norm: nn.Module) -> NormSplit:
    """The affine part of a norm module and what stays in the graph."""
    if isinstance(norm, (RMSNorm, LayerNorm)) and norm.eps >= DISABLED_NORM_EPS:
        # a disabled (FakeLN-style) norm is a fixed linear map, centering included: it goes whole,
        # as graph_passes/disabled_norm.py folds it (error ~ var(x) / (2 eps))
        return NormSplit(norm.weight / math.sqrt(norm.eps), getattr(norm, "bias", None), nn.Identity(),
                         center=isinstance(norm, LayerNorm))
    if isinstance(norm, RMSNorm):
        return NormSplit(norm.weight, None, ScalelessRMSNorm(norm.weight.shape[0], norm.eps))
    if isinstance(norm, LayerNorm):
        return NormSplit(norm.weight, norm.bias, ScalelessLayerNorm(norm.weight.shape[0], norm.eps))
    if isinstance(norm, DyT):
        return NormSplit(norm.weight, norm.bias, DyTCore(norm.alpha))
    if isinstance(norm, TaperNorm):
        if norm.gate.value != 0.0:
            raise ValueError(f"TaperNorm gate {norm.gate.value:g}; folding needs gate 0")
        return NormSplit(norm.c * norm.weight_tilde, norm.bias_tilde, nn.Identity())
    return NormSplit(None, None, norm)


@torch.no_grad()
def _fold_into(linear: nn.Linear, split: NormSplit, weights: bool = True) -> None:
    """linear(core(x) * scale + shift) == linear'(core(x)): W' = W diag(scale), b' = b + W shift;
    with centering, W' minus its mean over the input axis (W' C, C = I - 11^T/d). weights=False: W holds
    the fold already (a quantized graph's weights); only the bias changes (no shift: it would read W)."""
    scale, shift = split.scale, split.shift
    w = linear.weight                                   # [out, in]
    if not weights:
        if shift is not None:
            raise ValueError("a shift folds through the float weights: fold with weights=True")
        return
    if shift is not None:
        extra = w @ shift.detach()
        if linear.bias is None:
            linear.bias = nn.Parameter(extra.clone())
        else:
            linear.bias.add_(extra)
    if scale is not None:
        w.mul_(scale.detach()[None, :])
    if split.center:
        w.sub_(w.mean(dim=1, keepdim=True))


def _fold(parent: nn.Module, attr: str, linears: list[nn.Linear], weights: bool = True) -> None:
    split = _split_norm(getattr(parent, attr))
    for lin in linears:
        _fold_into(lin, split, weights)
    setattr(parent, attr, split.core)


@torch.no_grad()
def _fold_output(parent: nn.Module, attr: str, linear: nn.Linear, weights: bool = True) -> None:
    """A g = 0 TaperNorm after `linear` (norm(linear(x)) == linear'(x)) into its output rows, in place;
    any other norm stays. weights=False: the bias alone (W holds the fold already)."""
    norm = getattr(parent, attr)
    if not isinstance(norm, TaperNorm):
        return
    split = _split_norm(norm)
    reps = linear.out_features // split.scale.shape[0]              # the heads of a per-head QK-norm
    scale = split.scale.detach().repeat(reps)                       # [out]
    if weights:
        linear.weight.mul_(scale[:, None])
    shift = None if split.shift is None else split.shift.detach().repeat(reps)
    if linear.bias is not None:
        linear.bias.mul_(scale)
        if shift is not None:
            linear.bias.add_(shift)
    elif shift is not None:
        linear.bias = nn.Parameter(shift.clone())
    setattr(parent, attr, nn.Identity())


@torch.no_grad()
def fold_block_norms(block: nn.Module, weights: bool = True) -> None:
    """Fold one block's norms, in place (the reference of a quantized graph folds block by block:
    export/quant_reference.py): the pre-norms into the q/k/v and MLP input projections, the g = 0
    TaperNorms no matrix follows (QK-norms, post-sublayer norms) into the matrices before them.
    weights=False: the norms and biases alone, for weights that hold the fold already."""
    mlp_in = [block.mlp.up_proj] + ([block.mlp.gate_proj] if hasattr(block.mlp, "gate_proj") else [])
    if block.ln_1 is not None:
        _fold(block, "ln_1", [block.attn.q_proj, block.attn.k_proj, block.attn.v_proj], weights)
    if block.ln_2 is not None:
        _fold(block, "ln_2", mlp_in, weights)
    if block.attn.qk_norm:
        _fold_output(block.attn, "q_norm", block.attn.q_proj, weights)
        _fold_output(block.attn, "k_norm", block.attn.k_proj, weights)
    if block.post_attn_norm is not None:
        _fold_output(block, "post_attn_norm", block.attn.out_proj, weights)
    if block.post_mlp_norm is not None:
        _fold_output(block, "post_mlp_norm", block.mlp.down_proj, weights)


def keeps_tied_final_norm(model: Decoder) -> bool:
    """Whether the graph passes leave the final norm's gamma in its op (norm_gamma: a real RMSNorm /
    LayerNorm feeding a tied head keeps the head the embedding's table) instead of folding it."""
    ln_f = model.ln_f
    return (model.cfg.tie_embeddings and isinstance(ln_f, (RMSNorm, LayerNorm))
            and ln_f.eps < DISABLED_NORM_EPS)


@torch.no_grad()
def fold_final_norm(model: Decoder, keep_tied: bool = False) -> None:
    """Fold the final norm into the LM head, in place; a tied head is untied (cloned) first, or,
    with keep_tied where keeps_tied_final_norm holds, the norm is left as it is."""
    if isinstance(model.ln_f, nn.Identity) or (keep_tied and keeps_tied_final_norm(model)):
        return
    if model.lm_head.weight is model.wte.weight:
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    _fold(model, "ln_f", [model.lm_head])


@torch.no_grad()
def fold_norms(model: Decoder, keep_tied: bool = False) -> Decoder:
    """A copy with every norm's affine part (gamma/beta, c*gamma_tilde/beta_tilde, a disabled
    norm whole) folded into the linears it feeds; the tied head is untied (cloned) when the
    final norm folds into it. keep_tied: as the graph passes do (fold_final_norm)."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        fold_block_norms(block)
    fold_final_norm(model, keep_tied)
    return model.eval()


def folded_norm_names(model: Decoder, keep_tied: bool = True) -> list[str]:
    """The norms fold_norms(model, keep_tied) folds: every pre-norm, the final one unless kept (a tied
    head), and a QK-norm or post-sublayer norm only as a TaperNorm (a live one stays whole)."""
    after_matrix = ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
    kept = {"ln_f"} if keep_tied and keeps_tied_final_norm(model) else set()
    return [n for n in model.cfg.norm_names() if n not in kept and
            (not n.endswith(after_matrix) or isinstance(model.get_submodule(n), TaperNorm))]


FOLDED_NORM_CLASSES = (ScalelessRMSNorm, ScalelessLayerNorm, DyTCore)
