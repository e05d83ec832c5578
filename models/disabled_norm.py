"""Disabled norms (eps >= DISABLED_NORM_EPS): how far they are from the linear map they stand for.

LN-free GPT-2 checkpoints (FakeLN, Baroni et al. 2025) keep their LayerNorms with
eps = 1e12 and gamma scaled by 1e6 / std. Such a norm is, up to a relative error
of about var(x) / (2 eps),

    LN(x) = (x - mean x) * gamma / sqrt(var x + eps) + beta  ~  (x - mean x) * gamma / sqrt(eps) + beta

(RMSNorm alike, with mean(x^2) for var and no centering), which graph_passes folds
into the next linear layer completely. `approximation_error` measures both sides
of that "about" on real inputs: the worst var(x) / (2 eps) over every disabled
norm's inputs, and the largest logit change when every disabled norm is replaced
by its linear limit, in float64 so that rounding does not hide or fake it.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from models.norms import LayerNorm, RMSNorm

DISABLED_NORM_EPS = 1e6  # eps this large turns a norm into a fixed scale (FakeLN-style); graph_passes agrees


def disabled_norms(model: nn.Module) -> dict[str, nn.Module]:
    """LayerNorm / RMSNorm modules whose eps is at least DISABLED_NORM_EPS, by name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (LayerNorm, RMSNorm)) and m.eps >= DISABLED_NORM_EPS}


class LinearLimit(nn.Module):
    """The map a disabled norm stands for: (x - mean x) * gamma / sqrt(eps) + beta (no centering for RMSNorm)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.center = isinstance(norm, LayerNorm)
        self.scale = norm.weight.detach() / math.sqrt(norm.eps)
        self.bias = getattr(norm, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.center:
            x = x - x.mean(dim=-1, keepdim=True)
        y = x * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias.detach().to(x.dtype)


def linearized(model: nn.Module) -> nn.Module:
    """A copy of `model` with every disabled norm replaced by its linear limit."""
    out = copy.deepcopy(model)
    for name in disabled_norms(out):
        parent, _, leaf = name.rpartition(".")
        owner = out.get_submodule(parent) if parent else out
        setattr(owner, leaf, LinearLimit(getattr(owner, leaf)))
    return out


@dataclass
class EpsApproximation:
    layers: int                  # disabled norms in the model
    eps: float                   # the smallest eps among them
    worst_rel_error: float       # max over their inputs (every token) of var(x) / (2 eps)
    worst_layer: str
    max_abs_logit_diff: float    # exact model vs its linear limit, float64, on the same tokens
    tokens: int

    def line(self) -> str:
        return (f"{self.layers} disabled norm(s) (eps >= {self.eps:g}) stand for their linear limit up to "
                f"var(x)/(2 eps) <= {self.worst_rel_error:.3g} (worst {self.worst_layer}); the linear limit moves "
                f"logits by at most {self.max_abs_logit_diff:.3g} (float64, {self.tokens} tokens)")


@torch.no_grad()
def approximation_error(model: nn.Module, batches: list[torch.Tensor]) -> EpsApproximation | None:
    """None without disabled norms; else the measured error on `batches` (input_ids [B, T] each)."""
    norms = disabled_norms(model)
    if not norms:
        return None
    exact = copy.deepcopy(model).double().eval()
    limit = linearized(exact).eval()
    worst = {name: 0.0 for name in norms}
    hooks = []
    for name, m in disabled_norms(exact).items():
        def hook(module, args, name=name):
            x = args[0]
            spread = x.var(dim=-1, unbiased=False) if isinstance(module, LayerNorm) else x.pow(2).mean(dim=-1)
            worst[name] = max(worst[name], float(spread.max()) / (2 * module.eps))
        hooks.append(m.register_forward_pre_hook(hook))
    diff, tokens = 0.0, 0
    try:
        for ids in batches:
            diff = max(diff, float((exact(ids) - limit(ids)).abs().max()))
            tokens += ids.numel()
    finally:
        for h in hooks:
            h.remove()
    name = max(worst, key=worst.get)
    return EpsApproximation(len(norms), min(m.eps for m in norms.values()), worst[name], name, diff, tokens)
