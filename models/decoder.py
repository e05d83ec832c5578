"""Reference pre-norm decoder-only transformer with a fixed-capacity KV cache.

    tokens [+ learned positions] -> [ x + attn(norm1(x)) ; x + mlp(norm2(x)) ] * n_layer -> norm_f -> lm_head

One config (DecoderConfig) spans our own presets and the Hugging Face families
models/convert.py reads (GPT-2, Llama, Qwen2, Mistral): each architectural choice
is a field with the Hugging Face default semantics, and the defaults are exactly
what checkpoint format 1 meant (learned positions, biases everywhere, MLP 4 x
d_model, tanh GELU), so old checkpoints load unchanged.

  positions   learned table (GPT-2) | rotary (rope: theta, HF rotate-half layout,
              optionally only the first rotary_dim dims of a head, llama3/linear scaling)
  attention   n_head query heads sharing n_kv_head key/value heads (grouped-query
              attention; the cache holds only the n_kv_head heads)
  biases      per projection group: q/k/v, attention output, MLP
  MLP         plain (up, act, down) or gated (act(gate) * up, down); hidden size an integer
  head        tied to the token embedding or its own matrix

The norm kind (rmsnorm | layernorm | taper | dyt) comes from DecoderConfig. One
forward serves training (no cache), prefill (T tokens) and decode (T = 1): with a
cache, each sequence b writes its T new keys/values at position[b] and attends to
cache slots j <= position[b] + t, so sequences of a batch may sit at different
positions (prompts of different lengths need no attention-mask input).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import attend
from models.kv_cache import KVCacheLayout, write_cache
from models.norms import DyT, LayerNorm, NORM_KINDS, RMSNorm, TaperGate, TaperNorm

TAPER_SCOPES = ("internal", "all")
MLP_KINDS = ("gelu", "swiglu")               # plain (up, act, down) | gated (act(gate) * up, down)
POS_EMBEDDINGS = ("learned", "rope")
# HF activation names -> torch; gelu_new is GPT-2's tanh approximation (HF gelu_pytorch_tanh is the same)
ACTIVATIONS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu, "silu": F.silu}
ROPE_TYPES = ("default", "linear", "llama3")
MAX_LAYERS = 4096
# the project's float dtype names (core/contract.py; numpy: core.contract.np_dtype) -> torch
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class DecoderConfig:
    vocab_size: int = 2048
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    max_seq_len: int = 256        # KV-cache capacity S_max (and size of the learned position table)
    mlp_ratio: int = 4
    mlp: str = "gelu"             # gelu: plain (up, act, down) | swiglu: gated (act(gate) * up, down)
    norm: str = "rmsnorm"         # rmsnorm | layernorm | taper | dyt
    taper_scope: str | None = None  # internal (final norm stays real) | all; taper only
    taper_base: str = "rms"       # normalized branch of TaperNorm: rms | ln
    taper_affine: bool = False    # linear branch carries beta_tilde
    final_norm: bool = True       # False: no norm before the head (All-Taper without anchor)
    tie_embeddings: bool = True
    eps: float = 1e-5             # every norm's eps (HF layer_norm_epsilon / rms_norm_eps)
    dyt_alpha_init: float = 0.5
    # --- format 2: the Hugging Face families (defaults = what format 1 meant) ---
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head (HF num_key_value_heads)
    head_size: int | None = None  # width of one head; None: d_model // n_head (HF head_dim)
    pos_embedding: str = "learned"  # learned (a table of max_seq_len rows, GPT-2) | rope
    rope_theta: float = 10000.0
    rotary_dim: int | None = None   # rope on the first rotary_dim dims of each head; None: all (HF partial_rotary_factor)
    rope_scaling: dict | None = None  # None | {"rope_type": "linear", "factor"} | {"rope_type": "llama3", ...} (HF fields)
    qkv_bias: bool = True         # biases of q/k/v (GPT-2, Qwen2: yes; Llama: attention_bias)
    out_bias: bool = True         # bias of the attention output projection
    mlp_bias: bool = True         # biases of the MLP projections (Llama: mlp_bias)
    mlp_hidden: int | None = None  # MLP hidden width; None: mlp_ratio * d_model (HF intermediate_size / n_inner)
    activation: str | None = None  # gelu_new (tanh) | gelu (erf) | relu | silu; None: gelu_new for gelu, silu for swiglu
    layer_eps: dict = field(default_factory=dict)  # eps of single norms, {"blocks.0.ln_2": 1e12}, over `eps`
    extra: dict = field(default_factory=dict, compare=False)  # free-form notes, not architecture

    def validate(self) -> None:
        """Raises ValueError naming the field, the value and what was expected."""
        def need(cond, name, expected):
            if not cond:
                raise ValueError(f"{name} = {getattr(self, name)!r}; expected {expected}")

        def positive_int(v):
            return isinstance(v, int) and not isinstance(v, bool) and v > 0
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "max_seq_len", "mlp_ratio"):
            need(positive_int(getattr(self, name)), name, "a positive integer")
        for name in ("n_kv_head", "head_size", "mlp_hidden", "rotary_dim"):
            need(getattr(self, name) is None or positive_int(getattr(self, name)), name, "null or a positive integer")
        if self.head_size is None:
            need(self.d_model % self.n_head == 0, "n_head", f"a divisor of d_model ({self.d_model})")
        need(self.n_head % self.kv_heads == 0, "n_kv_head", f"a divisor of n_head ({self.n_head})")
        need(self.norm in NORM_KINDS, "norm", f"one of {', '.join(NORM_KINDS)}")
        need(self.mlp in MLP_KINDS, "mlp", f"one of {', '.join(MLP_KINDS)}")
        need(self.activation is None or self.activation in ACTIVATIONS, "activation",
             f"null or one of {', '.join(ACTIVATIONS)}")
        need(self.pos_embedding in POS_EMBEDDINGS, "pos_embedding", f"one of {', '.join(POS_EMBEDDINGS)}")
        if self.pos_embedding == "rope":
            need(self.head_dim % 2 == 0, "head_size", "an even head width for rope")
            need(self.rotary_dim is None or (self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0),
                 "rotary_dim", f"an even number <= the head width {self.head_dim}")
            need(isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0, "rope_theta", "a positive number")
            need(self.rope_scaling is None or (isinstance(self.rope_scaling, dict)
                                               and self.rope_scaling.get("rope_type") in ROPE_TYPES),
                 "rope_scaling", f"null or a dict with rope_type one of {', '.join(ROPE_TYPES)}")
        for name in ("qkv_bias", "out_bias", "mlp_bias", "tie_embeddings", "final_norm", "taper_affine"):
            need(isinstance(getattr(self, name), bool), name, "true or false")
        if self.norm == "taper":
            need(self.taper_scope in TAPER_SCOPES, "taper_scope", "'internal' or 'all' for norm 'taper'")
            need(self.taper_base in ("rms", "ln"), "taper_base", "'rms' or 'ln'")
        else:
            need(self.taper_scope is None, "taper_scope", f"null for norm {self.norm!r}")
        need(isinstance(self.eps, (int, float)) and not isinstance(self.eps, bool) and self.eps > 0, "eps",
             "a positive number")
        # a bound, so that a corrupt config (n_layer 2**40) is an error line, not every byte of memory
        # spent listing its norms; the deepest published decoders have a few hundred layers
        need(self.n_layer <= MAX_LAYERS, "n_layer", f"at most {MAX_LAYERS:,} layers")
        names = set(self.norm_names())
        need(isinstance(self.layer_eps, dict) and set(self.layer_eps) <= names
             and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in self.layer_eps.values()),
             "layer_eps", "a map from norm names (blocks.<i>.ln_1, blocks.<i>.ln_2, ln_f) to positive numbers")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_head

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.d_model

    @property
    def act(self) -> str:
        return self.activation or ("silu" if self.mlp == "swiglu" else "gelu_new")

    def norm_names(self) -> list[str]:
        """Every norm of the model by module name (ln_f only when the model has a final norm)."""
        return ([f"blocks.{i}.{n}" for i in range(self.n_layer) for n in ("ln_1", "ln_2")]
                + (["ln_f"] if self.final_norm else []))

    def eps_of(self, name: str) -> float:
        return self.layer_eps.get(name, self.eps)

    def approx_param_count(self) -> int:
        """Parameters of the model this config builds, without building it (for memory checks)."""
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (2 * self.n_head + 2 * self.kv_heads)
        mlp = (3 if self.mlp == "swiglu" else 2) * d * self.hidden
        block = attn + mlp + 8 * d + self.hidden
        head = 0 if self.tie_embeddings else self.vocab_size * d
        pos = self.max_seq_len * d if self.pos_embedding == "learned" else 0
        return self.vocab_size * d + pos + self.n_layer * block + head

    def cache_layout(self) -> KVCacheLayout:
        return KVCacheLayout(self.n_layer, self.kv_heads, self.head_dim, self.max_seq_len)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def make_norm(cfg: DecoderConfig, gate: TaperGate, tapered: bool, name: str) -> nn.Module:
    """The norm module `name` (e.g. blocks.0.ln_1) of the network."""
    eps = cfg.eps_of(name)
    if cfg.norm == "taper":
        if tapered:
            return TaperNorm(cfg.d_model, gate, cfg.taper_base, cfg.taper_affine, eps)
        return RMSNorm(cfg.d_model, eps) if cfg.taper_base == "rms" else LayerNorm(cfg.d_model, eps)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.d_model, eps)
    return DyT(cfg.d_model, cfg.dyt_alpha_init)


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] of the rotary embedding, as Hugging Face computes them."""
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {"rope_type": "default"}
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # transformers modeling_rope_utils._compute_llama3_parameters
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos, sin [B, T, rotary_dim] of positions [B, T] (HF layout: the frequencies twice, concatenated)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)   # [rotary_dim / 2]

    def forward(self, pos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 angles whatever the model's dtype (as Hugging Face computes them); apply_rope casts cos/sin
        freqs = pos_ids[..., None].float() * self.inv_freq.float()               # [B, T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)                                  # [B, T, rotary_dim]
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


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        q_width, kv_width = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, q_width, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, kv_width, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv_width, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(q_width, cfg.d_model, bias=cfg.out_bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [B, n, T, D]

    def forward(self, x, mask, cache=None, position=None, rope=None):
        q = self._heads(self.q_proj(x), self.n_head)            # [B, H, T, D]
        k = self._heads(self.k_proj(x), self.n_kv_head)         # [B, H_kv, T, D]
        v = self._heads(self.v_proj(x), self.n_kv_head)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k = write_cache(cache[0], k, position)   # [B, H_kv, S_max, D]
            v = write_cache(cache[1], v, position)
            cache = (k, v)
        b, _, t, d = q.shape
        y = attend(q, k, v, mask).transpose(1, 2).reshape(b, t, self.n_head * d)   # models/attention.py
        return self.out_proj(y), cache


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.kind, self.act = cfg.mlp, ACTIVATIONS[cfg.act]
        self.up_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.mlp_bias)
        if cfg.mlp == "swiglu":
            self.gate_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.hidden, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, gate: TaperGate, index: int):
        super().__init__()
        self.ln_1 = make_norm(cfg, gate, tapered=True, name=f"blocks.{index}.ln_1")
        self.attn = Attention(cfg)
        self.ln_2 = make_norm(cfg, gate, tapered=True, name=f"blocks.{index}.ln_2")
        self.mlp = MLP(cfg)

    def forward(self, x, mask, cache=None, position=None, rope=None):
        a, cache = self.attn(self.ln_1(x), mask, cache, position, rope)
        x = x + a
        return x + self.mlp(self.ln_2(x)), cache


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.gate = TaperGate(1.0)  # the one controller every TaperNorm reads
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.pos_embedding == "learned":
            self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        else:
            self.rotary = RotaryEmbedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, self.gate, i) for i in range(cfg.n_layer))
        tapered_final = cfg.norm == "taper" and cfg.taper_scope == "all"
        self.ln_f = make_norm(cfg, self.gate, tapered_final, "ln_f") if cfg.final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self.init_module_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @staticmethod
    def init_module_weights(m: nn.Module) -> None:
        """The random init of one module's own weights (applied to every module at construction; train/sharded.py
        replays it one module at a time to build a sharded model without the whole one)."""
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
        pos_ids, mask = self.positions_and_mask(input_ids, position if cache is not None else None)
        x = self.wte(input_ids)                                                            # [B, T, d]
        rope = None
        if self.cfg.pos_embedding == "learned":
            x = x + self.wpe(pos_ids)
        else:
            rope = self.rotary(pos_ids)                                                    # cos, sin [B, T, rd]
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, mask, None if cache is None else cache[i], position, rope)
            new_cache.append(layer_cache)
        h = self.ln_f(x)
        logits = self.lm_head(h)
        out = (logits,) if cache is None else (logits, new_cache)
        if return_hidden:
            out = out + (h,)
        return out[0] if len(out) == 1 else out

    def positions_and_mask(self, input_ids: torch.Tensor, position: torch.Tensor | None):
        """Position ids [B, T] of the tokens and the attention mask [B, 1, T, S] (S: the cache's
        capacity with a cache, i.e. with `position`; else T)."""
        b, t = input_ids.shape
        if position is None:
            pos_ids = torch.arange(t, device=input_ids.device)[None, :].expand(b, t)      # [B, T]
            keys = torch.arange(t, device=input_ids.device)
        else:
            pos_ids = position[:, None] + torch.arange(t, device=input_ids.device)[None, :]  # [B, T]
            keys = torch.arange(self.cfg.max_seq_len, device=input_ids.device)
        return pos_ids, (keys[None, None, :] <= pos_ids[:, :, None])[:, None]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
