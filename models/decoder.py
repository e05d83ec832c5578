"""Reference pre-norm decoder-only transformer with a fixed-capacity KV cache.

    tokens + positions -> [ x + attn(norm1(x)) ; x + mlp(norm2(x)) ] * n_layer -> norm_f -> lm_head

The norm kind (rmsnorm | layernorm | taper | dyt) comes from DecoderConfig. One
forward serves training (no cache), prefill (T tokens) and decode (T = 1): with a
cache, each sequence b writes its T new keys/values at position[b] and attends to
cache slots j <= position[b] + t, so sequences of a batch may sit at different
positions (prompts of different lengths need no attention-mask input).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import attend
from models.kv_cache import KVCacheLayout, write_cache
from models.norms import DyT, LayerNorm, NORM_KINDS, RMSNorm, TaperGate, TaperNorm

TAPER_SCOPES = ("internal", "all")
MLP_KINDS = ("gelu", "swiglu")


@dataclass
class DecoderConfig:
    vocab_size: int = 2048
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    max_seq_len: int = 256        # KV-cache capacity S_max and size of the position table
    mlp_ratio: int = 4
    mlp: str = "gelu"             # gelu (up, down) | swiglu (gate, up, down)
    norm: str = "rmsnorm"         # rmsnorm | layernorm | taper | dyt
    taper_scope: str | None = None  # internal (final norm stays real) | all; taper only
    taper_base: str = "rms"       # normalized branch of TaperNorm: rms | ln
    taper_affine: bool = False    # linear branch carries beta_tilde
    final_norm: bool = True       # False: no norm before the head (All-Taper without anchor)
    tie_embeddings: bool = True
    eps: float = 1e-5
    dyt_alpha_init: float = 0.5
    extra: dict = field(default_factory=dict, compare=False)  # free-form notes, not architecture

    def validate(self) -> None:
        """Raises ValueError naming the field, the value and what was expected."""
        def need(cond, name, expected):
            if not cond:
                raise ValueError(f"{name} = {getattr(self, name)!r}; expected {expected}")
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "max_seq_len", "mlp_ratio"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "a positive integer")
        need(self.d_model % self.n_head == 0, "n_head", f"a divisor of d_model ({self.d_model})")
        need(self.norm in NORM_KINDS, "norm", f"one of {', '.join(NORM_KINDS)}")
        need(self.mlp in MLP_KINDS, "mlp", f"one of {', '.join(MLP_KINDS)}")
        if self.norm == "taper":
            need(self.taper_scope in TAPER_SCOPES, "taper_scope", "'internal' or 'all' for norm 'taper'")
            need(self.taper_base in ("rms", "ln"), "taper_base", "'rms' or 'ln'")
        else:
            need(self.taper_scope is None, "taper_scope", f"null for norm {self.norm!r}")
        need(isinstance(self.eps, (int, float)) and self.eps > 0, "eps", "a positive number")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def approx_param_count(self) -> int:
        """Parameters of the model this config builds, without building it (for memory checks)."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        mlp = (3 if self.mlp == "swiglu" else 2) * d * hidden
        block = 4 * d * d + mlp + 8 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.max_seq_len * d + self.n_layer * block + head

    def cache_layout(self) -> KVCacheLayout:
        return KVCacheLayout(self.n_layer, self.n_head, self.head_dim, self.max_seq_len)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def make_norm(cfg: DecoderConfig, gate: TaperGate, tapered: bool) -> nn.Module:
    """The norm module for one position in the network."""
    if cfg.norm == "taper":
        if tapered:
            return TaperNorm(cfg.d_model, gate, cfg.taper_base, cfg.taper_affine, cfg.eps)
        return RMSNorm(cfg.d_model, cfg.eps) if cfg.taper_base == "rms" else LayerNorm(cfg.d_model, cfg.eps)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.eps)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.d_model, cfg.eps)
    return DyT(cfg.d_model, cfg.dyt_alpha_init)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]

    def forward(self, x, mask, cache=None, position=None):
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if cache is not None:
            k = write_cache(cache[0], k, position)   # [B, H, S_max, D]
            v = write_cache(cache[1], v, position)
            cache = (k, v)
        y = attend(q, k, v, mask).transpose(1, 2).reshape(x.shape)       # models/attention.py
        return self.out_proj(y), cache


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.kind = cfg.mlp
        self.up_proj = nn.Linear(cfg.d_model, hidden)
        if cfg.mlp == "swiglu":
            self.gate_proj = nn.Linear(cfg.d_model, hidden)
        self.down_proj = nn.Linear(hidden, cfg.d_model)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, gate: TaperGate):
        super().__init__()
        self.ln_1 = make_norm(cfg, gate, tapered=True)
        self.attn = Attention(cfg)
        self.ln_2 = make_norm(cfg, gate, tapered=True)
        self.mlp = MLP(cfg)

    def forward(self, x, mask, cache=None, position=None):
        a, cache = self.attn(self.ln_1(x), mask, cache, position)
        x = x + a
        return x + self.mlp(self.ln_2(x)), cache


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.gate = TaperGate(1.0)  # the one controller every TaperNorm reads
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, self.gate) for _ in range(cfg.n_layer))
        tapered_final = cfg.norm == "taper" and cfg.taper_scope == "all"
        self.ln_f = make_norm(cfg, self.gate, tapered=tapered_final) if cfg.final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    # --- gate and taper layers ----------------------------------------------

    def set_gate(self, g: float) -> None:
        self.gate.set(g)

    def taper_layers(self) -> dict[str, TaperNorm]:
        return {name: m for name, m in self.named_modules() if isinstance(m, TaperNorm)}

    def taper_c(self) -> dict[str, float]:
        return {name: m.c for name, m in self.taper_layers().items()}

    # --- forward --------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor | None = None,
                cache: list | None = None, return_hidden: bool = False):
        """input_ids [B, T]; position [B] int64 (write offset of each sequence) with cache.

        Returns logits [B, T, V] and, with a cache, the list of updated (key, value)
        caches (the same tensors, written in place, outside export); with
        return_hidden, also the pre-logit hidden state [B, T, d] after norm_f.
        """
        b, t = input_ids.shape
        if cache is None:
            pos_ids = torch.arange(t, device=input_ids.device)[None, :].expand(b, t)      # [B, T]
            keys = torch.arange(t, device=input_ids.device)
        else:
            pos_ids = position[:, None] + torch.arange(t, device=input_ids.device)[None, :]  # [B, T]
            keys = torch.arange(self.cfg.max_seq_len, device=input_ids.device)
        mask = (keys[None, None, :] <= pos_ids[:, :, None])[:, None]                       # [B, 1, T, S]
        x = self.wte(input_ids) + self.wpe(pos_ids)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, mask, None if cache is None else cache[i], position)
            new_cache.append(layer_cache)
        h = self.ln_f(x)
        logits = self.lm_head(h)
        out = (logits,) if cache is None else (logits, new_cache)
        if return_hidden:
            out = out + (h,)
        return out[0] if len(out) == 1 else out

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
