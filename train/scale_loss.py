"""The fixed-target scale loss that anchors the pre-logit scale of All-Taper models.

    L_aux = lambda * mean over tokens of (log r(h) - log s_tgt)^2,   r(h) = sqrt(mean_d h^2 + eps)

h is the pre-logit hidden state (the output of the final, tapered norm) of each
token. A real norm is 0-homogeneous and pins that scale; once the final norm has
tapered to a linear map, cross-entropy keeps rewarding a larger scale (logit
chasing). L_aux is a restoring force along the radial direction only: its
gradient with respect to h is

    dL/dh = lambda * 2 (log r - log s_tgt) / N  *  h / (d r^2)

which is exactly zero for every token whose scale is on target, and is
scale-free (doubling or halving r costs the same). s_tgt is fixed: a number, or
(the default, "calib") the mean pre-logit r measured at calibration, i.e. the
scale the model had with its real final norm, so switching the loss on at
calibration does not move the model.
"""
from __future__ import annotations

import torch

AUX_EPS = 1e-12  # keeps log finite for an all-zero token; far below any real scale


def token_rms(h: torch.Tensor, eps: float = AUX_EPS) -> torch.Tensor:
    """r(h) per token: [..., d] -> [...]."""
    return torch.sqrt(h.pow(2).mean(dim=-1) + eps)


def scale_loss(h: torch.Tensor, s_tgt: float, lam: float) -> torch.Tensor:
    """lambda * mean_tokens (log r(h) - log s_tgt)^2 over h [..., d]."""
    if s_tgt <= 0:
        raise ValueError(f"s_tgt = {s_tgt}; expected > 0")
    if lam < 0:
        raise ValueError(f"lambda = {lam}; expected >= 0")
    logr = torch.log(token_rms(h if h.dtype == torch.float64 else h.float()))
    return lam * (logr - torch.log(torch.tensor(float(s_tgt)))).pow(2).mean()
