"""Normalization layers: RMSNorm, LayerNorm, TaperNorm and DyT.

TaperNorm (shared/design/METHOD.md section 1) blends a normalized branch with a
sample-independent linear branch under ONE gate shared by every tapered layer:

    TaperNorm(h; g) = g * N(h) * gamma + (1 - g) * (c * h * gamma_tilde [+ beta_tilde])

N(h) is h / rms(h) (base "rms") or the centred LayerNorm (base "ln"). At g = 0
the layer is the fixed map h -> h * (c * gamma_tilde) [+ beta_tilde], which is
exactly one Mul (and one Add) in the exported graph: graph_passes folds it into
the next MatMul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TaperGate:
    """The one global gate g in [0, 1] that every TaperNorm of a model reads.

    A plain Python float on purpose: export specializes on it, so a g = 0 model
    exports with no normalized branch at all, and there is a single place to
    change it (no per-layer copies to keep in sync).
    """

    def __init__(self, value: float = 1.0):
        self.value = float(value)

    def set(self, value: float) -> None:
        value = float(value)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"gate {value} is outside [0, 1]")
        self.value = value


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # F.rms_norm exports as one ONNX RMSNormalization (opset >= 23): the
        # strongest RMSNorm baseline, not the unfused Pow/ReduceMean/Sqrt form.
        return F.rms_norm(h, (h.shape[-1],), self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, (h.shape[-1],), self.weight, self.bias, self.eps)


class DyT(nn.Module):
    """Dynamic Tanh: gamma * tanh(alpha * x) + beta, alpha a learnable scalar."""

    def __init__(self, d: int, alpha_init: float = 0.5):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def pre_tanh(self, h: torch.Tensor) -> torch.Tensor:
        return self.alpha * h

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.pre_tanh(h)) + self.bias


class TaperNorm(nn.Module):
    """Gated normalization removal; see the module docstring for the formula.

    base:   "rms" (normalized branch h / rms(h)) or "ln" (centred LayerNorm).
    affine: the normalized branch carries beta and the linear branch beta_tilde.
    c:      per-layer scalar fixed by `calibrate` (least squares); a Python
            float, saved in the checkpoint's config.json, not a trained weight.
    """

    def __init__(self, d: int, gate: TaperGate, base: str = "rms", affine: bool = False,
                 eps: float = 1e-5):
        super().__init__()
        if base not in ("rms", "ln"):
            raise ValueError(f"TaperNorm base must be 'rms' or 'ln', got {base!r}")
        self.gate = gate
        self.base = base
        self.affine = affine
        self.eps = eps
        self.c = 1.0
        self.weight = nn.Parameter(torch.ones(d))          # gamma
        self.weight_tilde = nn.Parameter(torch.ones(d))    # gamma_tilde
        if affine:
            self.bias = nn.Parameter(torch.zeros(d))        # beta
            self.bias_tilde = nn.Parameter(torch.zeros(d))  # beta_tilde
        else:
            self.register_parameter("bias", None)
            self.register_parameter("bias_tilde", None)

    def normalized(self, h: torch.Tensor) -> torch.Tensor:
        """g = 1 branch: N(h) * gamma (+ beta)."""
        d = (h.shape[-1],)
        if self.base == "rms":
            out = F.rms_norm(h, d, self.weight, self.eps)
            return out if self.bias is None else out + self.bias
        return F.layer_norm(h, d, self.weight, self.bias, self.eps)

    def linear(self, h: torch.Tensor) -> torch.Tensor:
        """g = 0 branch: h * (c * gamma_tilde) (+ beta_tilde): one Mul (and Add) on export."""
        out = h * (self.c * self.weight_tilde)
        return out if self.bias_tilde is None else out + self.bias_tilde

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        g = self.gate.value
        if g == 0.0:
            return self.linear(h)
        if g == 1.0:
            return self.normalized(h)
        return g * self.normalized(h) + (1.0 - g) * self.linear(h)

    # --- calibration --------------------------------------------------------

    def _normalized_without_bias(self, h: torch.Tensor) -> torch.Tensor:
        d, w = (h.shape[-1],), self.weight.detach().to(h.dtype)
        if self.base == "rms":
            return F.rms_norm(h, d, w, self.eps)
        return F.layer_norm(h, d, w, None, self.eps)

    @torch.no_grad()
    def calibration_terms(self, h: torch.Tensor) -> tuple[float, float]:
        """Sums (num, den) over tokens for c = num / den.

        Least squares of the linear branch c * gamma * h against the normalized
        branch N(h) * gamma: c = E[<N(h) gamma, gamma h>] / E[||gamma h||^2],
        which for the RMS base is E[||gamma h||^2 / r(h)] / E[||gamma h||^2].
        Accumulate over calibration batches, then call `set_calibration`.
        """
        h = h.detach().double()  # float64 sums: calibration sets c once, make it exact
        target = self._normalized_without_bias(h)
        lin = h * self.weight.detach().double()
        return float((target * lin).sum()), float((lin * lin).sum())

    @torch.no_grad()
    def set_calibration(self, num: float, den: float) -> float:
        """Fix c = num / den and start gamma_tilde (and beta_tilde) from gamma (beta)."""
        if not den > 0:
            raise ValueError("TaperNorm calibration saw only zero activations (den = 0)")
        self.c = num / den
        self.weight_tilde.copy_(self.weight)
        if self.bias_tilde is not None:
            self.bias_tilde.copy_(self.bias)
        return self.c

    def calibrate(self, activations) -> float:
        """c from an iterable of activation tensors [..., d]; returns c."""
        num = den = 0.0
        for h in activations:
            n, d = self.calibration_terms(h)
            num, den = num + n, den + d
        return self.set_calibration(num, den)

    def extra_repr(self) -> str:
        return f"base={self.base}, affine={self.affine}, c={self.c:.6g}"


NORM_KINDS = ("rmsnorm", "layernorm", "taper", "dyt")
