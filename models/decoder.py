"""Reference decoder-only transformer with a fixed-capacity KV cache.

    tokens * embed_scale [+ learned positions]
      -> [ x + r * post1(attn(pre1(x))) ; x + r * post2(mlp(pre2(x))) ] * n_layer      (r: residual_scale)
      -> norm_f -> lm_head -> / logits_divisor -> soft-cap

One config (DecoderConfig) spans our own presets and the Hugging Face families
models/convert.py reads (GPT-2, Llama, Qwen2, Mistral, Qwen3, Gemma 1-3, Phi-3, OLMo 2,
SmolLM3, Granite): each architectural choice is a field with the Hugging Face default
semantics, and the defaults are exactly what checkpoint formats 1 and 2 meant (learned
positions, biases everywhere, MLP 4 x d_model, tanh GELU, pre-norms only), so old
checkpoints load unchanged and build the same graphs.

  positions   learned table (GPT-2) | rotary (rope: theta, HF rotate-half layout, optionally
              only the first rotary_dim dims of a head; linear / llama3 / yarn / longrope
              scaling; a second rope base for the local layers (Gemma 3; the sliding layers unless
              local_rope_layers says, and whether or not their window is dropped); no rope on the
              nope_layers (SmolLM3))
  attention   n_head query heads sharing n_kv_head key/value heads (grouped-query
              attention; the cache holds only the n_kv_head heads); the logit scale
              (1 / sqrt(head_dim) unless attn_scale), an optional tanh soft-cap, and a
              sliding window on the sliding_layers (keys p - window < j <= p)
  norms       norm_layout pre (ln_1, ln_2 before the sublayers) | sandwich (and post_attn_norm,
              post_mlp_norm on the sublayers' outputs, Gemma 2/3) | post (only the post norms,
              OLMo 2); qk_norm head (q_norm, k_norm over each head, before rope: Qwen3,
              Gemma 3) | proj (over the whole q / k projection: OLMo 2)
  biases      per projection group: q/k/v, attention output, MLP
  MLP         plain (up, act, down) or gated (act(gate) * up, down); hidden size an integer
  head        tied to the token embedding or its own matrix

The norm kind (rmsnorm | layernorm | taper | dyt) comes from DecoderConfig and is every
norm's (a taper model tapers every norm, the final one only with taper_scope all). One
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
from models.rope import ROPE_NEEDS, ROPE_TYPES, RotaryEmbedding, apply_rope, rope_frequencies

TAPER_SCOPES = ("internal", "all")
MLP_KINDS = ("gelu", "swiglu")               # plain (up, act, down) | gated (act(gate) * up, down)
POS_EMBEDDINGS = ("learned", "rope")
# HF activation names -> torch; gelu_new is GPT-2's tanh approximation (HF gelu_pytorch_tanh is the same)
ACTIVATIONS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu, "silu": F.silu}
NORM_LAYOUTS = ("pre", "sandwich", "post")  # which sublayer norms a block has (see the module docstring)
QK_NORMS = ("head", "proj")                 # q_norm / k_norm over each head | over the whole projection
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
    rope_scaling: dict | None = None  # None | {"rope_type": "linear" | "llama3" | "yarn" | "longrope", ...} (HF fields)
    qkv_bias: bool = True         # biases of q/k/v (GPT-2, Qwen2: yes; Llama: attention_bias)
    out_bias: bool = True         # bias of the attention output projection
    mlp_bias: bool = True         # biases of the MLP projections (Llama: mlp_bias)
    mlp_hidden: int | None = None  # MLP hidden width; None: mlp_ratio * d_model (HF intermediate_size / n_inner)
    activation: str | None = None  # gelu_new (tanh) | gelu (erf) | relu | silu; None: gelu_new for gelu, silu for swiglu
    layer_eps: dict = field(default_factory=dict)  # eps of single norms, {"blocks.0.ln_2": 1e12}, over `eps`
    # --- format 3: the 2026 families (defaults = what format 2 meant) ---
    norm_layout: str = "pre"      # pre | sandwich (pre and post norms: Gemma 2/3) | post (post norms only: OLMo 2)
    qk_norm: str | None = None    # None | head (per head over head_dim: Qwen3, Gemma 3) | proj (whole q/k: OLMo 2)
    embed_scale: float = 1.0      # token embeddings times this (Gemma: sqrt(d_model); Granite: embedding_multiplier)
    attn_scale: float | None = None  # attention logit scale; None: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar
    #                                  ** -0.5; Granite: attention_multiplier)
    attn_softcap: float | None = None   # attention logits -> cap * tanh(logits / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits (Gemma 2)
    residual_scale: float = 1.0   # each sublayer's output times this before the residual add (Granite)
    logits_divisor: float = 1.0   # output logits divided by this (Granite logits_scaling)
    sliding_window: int | None = None   # a sliding layer's query at position p sees keys p - window < j <= p
    sliding_layers: list = field(default_factory=list)   # indices of the sliding layers (the rest see the whole cache)
    local_rope_theta: float | None = None  # rope base of the local layers (Gemma 3: rope_local_base_freq, no scaling)
    # the layers rotated with local_rope_theta; None: the sliding layers (what a checkpoint without this field
    # meant). Kept apart from the mask: a window that covers the whole cache is dropped (plain causal attention),
    # but its layers keep their own rope base (Gemma 3 at a capacity <= its window)
    local_rope_layers: list | None = None
    nope_layers: list = field(default_factory=list)      # indices of layers without rotary embedding (SmolLM3)
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
                                               and self.rope_scaling.get("rope_type") in ROPE_TYPES
                                               and all(k in self.rope_scaling
                                                       for k in ROPE_NEEDS[self.rope_scaling["rope_type"]])),
                 "rope_scaling", f"null or a dict with rope_type one of {', '.join(ROPE_TYPES)} and that type's "
                 "parameters")
        for name in ("qkv_bias", "out_bias", "mlp_bias", "tie_embeddings", "final_norm", "taper_affine"):
            need(isinstance(getattr(self, name), bool), name, "true or false")
        self._validate_families(need)
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
             "layer_eps", "a map from norm names (blocks.<i>.ln_1, blocks.<i>.ln_2, ..., ln_f) to positive numbers")

    def _validate_families(self, need) -> None:
        """The format-3 fields (see validate)."""
        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        def layers(v):
            return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layer
                                               for i in v) and len(set(v)) == len(v)
        need(self.norm_layout in NORM_LAYOUTS, "norm_layout", f"one of {', '.join(NORM_LAYOUTS)}")
        need(self.qk_norm is None or self.qk_norm in QK_NORMS, "qk_norm", f"null or one of {', '.join(QK_NORMS)}")
        for name in ("embed_scale", "residual_scale", "logits_divisor"):
            need(number(getattr(self, name)), name, "a positive number")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
            need(getattr(self, name) is None or number(getattr(self, name)), name, "null or a positive number")
        need(self.sliding_window is None or (isinstance(self.sliding_window, int)
                                             and not isinstance(self.sliding_window, bool) and self.sliding_window > 0),
             "sliding_window", "null or a positive integer")
        for name in ("sliding_layers", "nope_layers"):
            need(layers(getattr(self, name)), name, f"a list of distinct layer indices in [0, {self.n_layer})")
        need(self.local_rope_layers is None or layers(self.local_rope_layers), "local_rope_layers",
             f"null or a list of distinct layer indices in [0, {self.n_layer})")
        need(not self.local_rope_layers or self.local_rope_theta is not None, "local_rope_layers",
             "null or empty when local_rope_theta is null")
        need(not self.sliding_layers or self.sliding_window is not None, "sliding_layers",
             "empty when sliding_window is null")
        need(self.local_rope_theta is None or self.pos_embedding == "rope", "local_rope_theta",
             "null unless pos_embedding is rope")
        need(not self.nope_layers or self.pos_embedding == "rope", "nope_layers", "empty unless pos_embedding is rope")

    @property
    def local_layers(self) -> list:
        """The layers rotated with local_rope_theta (when it is set): local_rope_layers, else the sliding layers."""
        return self.sliding_layers if self.local_rope_layers is None else self.local_rope_layers

    def rope_kind(self, i: int) -> str | None:
        """Which rotary embedding layer i uses: "global", "local" (its own base) or None (learned positions,
        a NoPE layer). Never the mask's business: the rope base does not change when a window is dropped."""
        if self.pos_embedding != "rope" or i in self.nope_layers:
            return None
        return "local" if self.local_rope_theta is not None and i in self.local_layers else "global"

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

    def block_norms(self) -> list[str]:
        """The norms of one block by their name in it, in the order the forward applies them."""
        pre, post = self.norm_layout in ("pre", "sandwich"), self.norm_layout in ("sandwich", "post")
        qk = ["attn.q_norm", "attn.k_norm"] if self.qk_norm else []
        return ((["ln_1"] if pre else []) + qk + (["post_attn_norm"] if post else [])
                + (["ln_2"] if pre else []) + (["post_mlp_norm"] if post else []))

    def norm_names(self) -> list[str]:
        """Every norm of the model by module name (ln_f only when the model has a final norm)."""
        return ([f"blocks.{i}.{n}" for i in range(self.n_layer) for n in self.block_norms()]
                + (["ln_f"] if self.final_norm else []))

    def norm_width(self, name: str) -> int:
        """The channels a norm normalizes: d_model, or a q / k norm's head_dim (per head) or projection width."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("q_norm", "k_norm"):
            return self.d_model
        if self.qk_norm == "head":
            return self.head_dim
        return self.head_dim * (self.n_head if leaf == "q_norm" else self.kv_heads)

    def eps_of(self, name: str) -> float:
        return self.layer_eps.get(name, self.eps)

    def approx_param_count(self) -> int:
        """Parameters of the model this config builds, without building it (for memory checks)."""
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (2 * self.n_head + 2 * self.kv_heads)
        mlp = (3 if self.mlp == "swiglu" else 2) * d * self.hidden
        extra_norms = sum(2 * self.norm_width(n) for n in self.block_norms() if n not in ("ln_1", "ln_2"))
        block = attn + mlp + 8 * d + self.hidden + extra_norms
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
    """The norm module `name` (e.g. blocks.0.ln_1, blocks.0.attn.q_norm) of the network."""
    eps, d = cfg.eps_of(name), cfg.norm_width(name)
    if cfg.norm == "taper":
        if tapered:
            return TaperNorm(d, gate, cfg.taper_base, cfg.taper_affine, eps)
        return RMSNorm(d, eps) if cfg.taper_base == "rms" else LayerNorm(d, eps)
    if cfg.norm == "rmsnorm":
        return RMSNorm(d, eps)
    if cfg.norm == "layernorm":
        return LayerNorm(d, eps)
    return DyT(d, cfg.dyt_alpha_init)


def rotary_embeddings(cfg: DecoderConfig) -> dict[str, RotaryEmbedding]:
    """The model's rotary embeddings by the layers they serve (DecoderConfig.rope_kind): "global", and
    "local" for the local layers when they have a rope base of their own (empty with learned positions)."""
    if cfg.pos_embedding != "rope":
        return {}
    dim = cfg.rotary_dim or cfg.head_dim
    out = {"global": RotaryEmbedding(cfg.rope_theta, dim, cfg.rope_scaling, cfg.max_seq_len)}
    if cfg.local_rope_theta is not None:
        out["local"] = RotaryEmbedding(cfg.local_rope_theta, dim, None)
    return out



class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, gate: TaperGate, index: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap
        q_width, kv_width = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, q_width, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, kv_width, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv_width, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(q_width, cfg.d_model, bias=cfg.out_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:     # tapered whatever the scope: only the final norm stays real with internal-taper
            self.q_norm = make_norm(cfg, gate, tapered=True, name=f"blocks.{index}.attn.q_norm")
            self.k_norm = make_norm(cfg, gate, tapered=True, name=f"blocks.{index}.attn.k_norm")

    def _heads(self, x: torch.Tensor, n: int, norm: nn.Module | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        x = x.view(b, t, n, self.head_dim)                      # [B, T, n, D]
        if norm is not None:                                    # a per-head norm, over D (Qwen3, Gemma 3)
            x = norm(x)
        return x.transpose(1, 2)                                # [B, n, T, D]

    def forward(self, x, mask, cache=None, position=None, rope=None):
        q, k = self.q_proj(x), self.k_proj(x)                   # [B, T, H * D], [B, T, H_kv * D]
        if self.qk_norm == "proj":                              # over the whole projection (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        per_head = self.qk_norm == "head"
        q = self._heads(q, self.n_head, self.q_norm if per_head else None)         # [B, H, T, D]
        k = self._heads(k, self.n_kv_head, self.k_norm if per_head else None)      # [B, H_kv, T, D]
        v = self._heads(self.v_proj(x), self.n_kv_head)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k = write_cache(cache[0], k, position)   # [B, H_kv, S_max, D]
            v = write_cache(cache[1], v, position)
            cache = (k, v)
        b, _, t, d = q.shape
        y = attend(q, k, v, mask, self.scale, self.softcap).transpose(1, 2).reshape(b, t, self.n_head * d)
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
    """One layer: x + r * post(attn(pre(x))), then the same with the MLP; a norm the layout lacks is
    None (no module under its name, so state dicts hold only the real ones)."""

    def __init__(self, cfg: DecoderConfig, gate: TaperGate, index: int):
        super().__init__()
        norms = set(cfg.block_norms())

        def norm(name):
            return make_norm(cfg, gate, tapered=True, name=f"blocks.{index}.{name}") if name in norms else None
        self.ln_1 = norm("ln_1")
        self.attn = Attention(cfg, gate, index)
        self.post_attn_norm = norm("post_attn_norm")
        self.ln_2 = norm("ln_2")
        self.mlp = MLP(cfg)
        self.post_mlp_norm = norm("post_mlp_norm")
        self.residual_scale = cfg.residual_scale

    def _residual(self, x, y, post):
        if post is not None:
            y = post(y)
        if self.residual_scale != 1.0:      # Granite's residual_multiplier
            y = y * self.residual_scale
        return x + y

    def forward(self, x, mask, cache=None, position=None, rope=None):
        a, cache = self.attn(x if self.ln_1 is None else self.ln_1(x), mask, cache, position, rope)
        x = self._residual(x, a, self.post_attn_norm)
        m = self.mlp(x if self.ln_2 is None else self.ln_2(x))
        return self._residual(x, m, self.post_mlp_norm), cache


@dataclass
class StepInputs:
    """What every layer of one forward reads besides its input: the tokens' positions, the masks
    and the rotary tables, computed once per forward and handed to each layer by layer()."""
    cfg: DecoderConfig
    pos_ids: torch.Tensor                    # [B, T]
    mask: torch.Tensor                       # bool [B, 1, T, S]: key j <= position
    sliding_mask: torch.Tensor | None        # the same and j > position - sliding_window
    ropes: dict                              # "global" / "local" -> (cos, sin) [B, T, rotary_dim]

    def layer(self, i: int) -> tuple[torch.Tensor, tuple | None]:
        """(mask, rope or None) of layer i."""
        mask = self.sliding_mask if i in self.cfg.sliding_layers else self.mask
        kind = self.cfg.rope_kind(i)
        return mask, None if kind is None else self.ropes[kind]


def step_inputs(cfg: DecoderConfig, rotaries: dict, input_ids: torch.Tensor,
                position: torch.Tensor | None) -> StepInputs:
    """Positions, masks and rope tables of one forward (S: the cache's capacity with `position`, else T)."""
    b, t = input_ids.shape
    if position is None:
        pos_ids = torch.arange(t, device=input_ids.device)[None, :].expand(b, t)        # [B, T]
        keys = torch.arange(t, device=input_ids.device)
    else:
        pos_ids = position[:, None] + torch.arange(t, device=input_ids.device)[None, :]  # [B, T]
        keys = torch.arange(cfg.max_seq_len, device=input_ids.device)
    mask = (keys[None, None, :] <= pos_ids[:, :, None])[:, None]                         # [B, 1, T, S]
    sliding = None
    if cfg.sliding_layers:      # transformers' sliding_window_overlay: kv_idx > q_idx - sliding_window
        sliding = mask & (keys[None, None, :] > pos_ids[:, :, None] - cfg.sliding_window)[:, None]
    used = {cfg.rope_kind(i) for i in range(cfg.n_layer)} - {None}
    return StepInputs(cfg, pos_ids, mask, sliding, {k: rotaries[k](pos_ids) for k in sorted(used)})


def embed_tokens(cfg: DecoderConfig, x: torch.Tensor) -> torch.Tensor:
    """The looked-up embeddings [B, T, d] as the first block reads them (Gemma, Granite scale them)."""
    return x * cfg.embed_scale if cfg.embed_scale != 1.0 else x


def finish_logits(cfg: DecoderConfig, logits: torch.Tensor) -> torch.Tensor:
    """The LM head's output [B, T, V] as the model returns it: Granite's divisor, Gemma 2's soft-cap."""
    if cfg.logits_divisor != 1.0:
        logits = logits / cfg.logits_divisor
    if cfg.final_softcap is not None:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.gate = TaperGate(1.0)  # the one controller every TaperNorm reads
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.pos_embedding == "learned":
            self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        rotaries = rotary_embeddings(cfg)
        if rotaries:
            self.rotary = rotaries["global"]
        if "local" in rotaries:
            self.rotary_local = rotaries["local"]
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

    def rotaries(self) -> dict[str, RotaryEmbedding]:
        return {k: getattr(self, attr) for k, attr in (("global", "rotary"), ("local", "rotary_local"))
                if hasattr(self, attr)}

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
        steps = self.step_inputs(input_ids, position if cache is not None else None)
        x = embed_tokens(self.cfg, self.wte(input_ids))                                    # [B, T, d]
        if self.cfg.pos_embedding == "learned":
            x = x + self.wpe(steps.pos_ids)
        new_cache = []
        for i, block in enumerate(self.blocks):
            mask, rope = steps.layer(i)
            x, layer_cache = block(x, mask, None if cache is None else cache[i], position, rope)
            new_cache.append(layer_cache)
        h = self.ln_f(x)
        logits = finish_logits(self.cfg, self.lm_head(h))
        out = (logits,) if cache is None else (logits, new_cache)
        if return_hidden:
            out = out + (h,)
        return out[0] if len(out) == 1 else out

    def step_inputs(self, input_ids: torch.Tensor, position: torch.Tensor | None) -> StepInputs:
        """Positions [B, T], masks [B, 1, T, S] and rope tables of a forward (S: the cache's capacity
        with a cache, i.e. with `position`; else T)."""
        return step_inputs(self.cfg, self.rotaries(), input_ids, position)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
