"""Rotary position embeddings as Hugging Face computes them (transformers 5, modeling_rope_utils).

    inv_freq [rotary_dim / 2] from (theta, scaling)    default | linear | llama3 | yarn | longrope
    cos, sin [B, T, rotary_dim] = cos / sin(cat(f, f)) * attention_scaling,  f = positions * inv_freq
    apply_rope(x [B, H, T, D], cos, sin): the first rotary_dim dims of each head rotated (rotate-half layout)

yarn and longrope also scale cos and sin by an attention factor. longrope has two frequency sets:
transformers uses the long one for a forward whose last position is beyond the pretraining length
(original_max_position_embeddings), the short one otherwise, decided per forward call from
max(position) + 1, so RotaryEmbedding picks per call the same way (a Where on one scalar in the
exported graph; keys already in the cache keep the rotation they were written with, as in
transformers' cache).
"""
from __future__ import annotations

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# what each rope type reads from its scaling dict (transformers' required keys; the optional ones have defaults)
ROPE_NEEDS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim                    # [dim / 2]


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """transformers' _compute_llama3_parameters."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters: inverse frequencies and the attention factor."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (float(_mscale(factor, mscale) / _mscale(factor, mscale_all)) if mscale and mscale_all
                     else _mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001       # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope_attention(s: dict) -> float:
    """transformers' default attention factor of longrope (the converter fills `factor` in from
    max_position_embeddings / original_max_position_embeddings when a config leaves it out)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s.get("factor")
    if factor is None:      # transformers' own default needs the model's max_position_embeddings, not kept here
        raise ValueError(LONGROPE_NEEDS)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(s["original_max_position_embeddings"]))


LONGROPE_NEEDS = ("a longrope scaling with 'factor' or 'attention_factor' (its attention factor comes from one of "
                  "them; transformers' factor is max_position_embeddings / original_max_position_embeddings)")


def check_rope(theta: float, dim: int, scaling: dict | None) -> None:
    """The rope's frequencies computed once, as a model built from these settings would: ValueError
    `rope_scaling = {...}; expected ...` (DecoderConfig.validate's form) for settings they cannot be computed
    from, e.g. a longrope with neither 'factor' nor 'attention_factor', or a parameter that is not a number.
    Without it such a config.json passed validation and raised a KeyError (a traceback) where the model was
    built (issue 42)."""
    try:
        inv_freq, long_inv_freq, _, _ = rope_frequencies(theta, dim, scaling)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError, RuntimeError) as e:
        why = str(e) if isinstance(e, ValueError) and str(e) == LONGROPE_NEEDS else \
            f"numbers its rope_type can be computed from ({type(e).__name__}: {e})"
        raise ValueError(f"rope_scaling = {scaling!r}; expected {why}") from None
    lengths = [len(scaling[k]) for k in ("short_factor", "long_factor")] if inv_freq is not None and \
        long_inv_freq is not None else []
    if any(n != dim // 2 for n in lengths):        # a list of one number broadcasts silently
        raise ValueError(f"rope_scaling = {scaling!r}; expected short_factor and long_factor of {dim // 2} "
                         f"numbers each (half the rotary width {dim}), found {' and '.join(map(str, lengths))}")


def rope_frequencies(theta: float, dim: int, scaling: dict | None):
    """(inv_freq [dim / 2], long inv_freq or None, switch length or None, attention scaling) of one rope."""
    s = scaling or {"rope_type": "default"}
    kind = s["rope_type"]
    exponents = _exponents(dim)
    if kind == "yarn":
        inv_freq, attention = _yarn(theta, dim, s)
        return inv_freq, None, None, attention
    if kind == "longrope":
        base = theta ** exponents
        short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * base)
        long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * base)
        return short, long, int(s["original_max_position_embeddings"]), _longrope_attention(s)
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, s)
    return inv_freq, None, None, 1.0


class RotaryEmbedding(nn.Module):
    """cos, sin [B, T, rotary_dim] of positions [B, T] (HF layout: the frequencies twice, concatenated)."""

    def __init__(self, theta: float, dim: int, scaling: dict | None = None, capacity: int | None = None):
        super().__init__()
        inv_freq, long_inv_freq, self.switch_after, self.attention_scaling = rope_frequencies(theta, dim, scaling)
        if self.switch_after is not None and capacity is not None and capacity <= self.switch_after:
            long_inv_freq, self.switch_after = None, None     # no position of the cache reaches the long set
        self.register_buffer("inv_freq", inv_freq, persistent=False)                 # [rotary_dim / 2]
        if long_inv_freq is not None:
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        self.theta, self.dim, self.scaling = theta, dim, scaling

    def reset_parameters(self, device=None) -> None:
        """Recompute the (non-persistent) frequency buffers, e.g. after a model was built on the meta device
        (then on the CPU unless `device` says)."""
        inv_freq, long_inv_freq, _, _ = rope_frequencies(self.theta, self.dim, self.scaling)
        device = device or ("cpu" if self.inv_freq.is_meta else self.inv_freq.device)
        self.inv_freq = inv_freq.to(device)
        if self.switch_after is not None:
            self.long_inv_freq = long_inv_freq.to(device)

    def forward(self, pos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.switch_after is not None:     # longrope: the long set once this call reaches past the switch
            inv_freq = torch.where(pos_ids.max() + 1 > self.switch_after, self.long_inv_freq, inv_freq)
        # float32 angles whatever the model's dtype (as Hugging Face computes them); apply_rope casts cos/sin
        freqs = pos_ids[..., None].float() * inv_freq.float()                   # [B, T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)                                  # [B, T, rotary_dim]
        if self.attention_scaling != 1.0:
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated on its first cos.shape[-1] dims; cos, sin [B, T, rotary_dim]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)                # [B, 1, T, rotary_dim]
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
