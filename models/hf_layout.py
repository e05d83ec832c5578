"""Which tensors a Hugging Face folder holds, with the shapes its config.json implies, and what each becomes.

Two layouts: GPT-2's (`gpt2_params`: Conv1D [in, out] weights, c_attn split into q/k/v) and
Llama's, which every other family shares (`llama_params`: nn.Linear weights under the decoder's
own projection names; the norms renamed by norm layout, NORM_NAMES; what the family's record in
models/families.py adds: fused projections split by rows, gains stored as w of 1 + w). A `Param`
is one stored tensor: its name without the base model's prefix, its shape, and our tensor(s) it
fills with the function that maps it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.decoder import DecoderConfig
from models.hf_fields import ConfigFields

HEAD = "lm_head.weight"
# buffers some saved models carry that are not weights (causal masks, rotary tables)
IGNORED = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


@dataclass
class Param:
    """One Hugging Face tensor, the shape config.json implies for it, and what it becomes."""
    hf_name: str
    shape: tuple[int, ...]
    targets: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)
    prefixed: bool = True        # stored under the base model's prefix (transformer. / model.); the head never is


def same(t):
    """A tensor stored as we keep it."""
    return t


def _t(t):
    return t.t()


def gpt2_params(f: ConfigFields, cfg: DecoderConfig) -> list[Param]:
    """GPT-2's Conv1D stores [in, out]: transposed into nn.Linear's [out, in]; c_attn is q, k, v side by side."""
    d, hidden, n_positions = cfg.d_model, cfg.hidden, f.int("n_positions")
    ps = [Param("wte.weight", (cfg.vocab_size, d), [("wte.weight", same)]),
          # positions beyond the KV-cache capacity can never be used: their rows are dropped
          Param("wpe.weight", (n_positions, d), [("wpe.weight", lambda t: t[:cfg.max_seq_len])]),
          Param("ln_f.weight", (d,), [("ln_f.weight", same)]), Param("ln_f.bias", (d,), [("ln_f.bias", same)])]
    for i in range(cfg.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        split = [(f"{b}attn.{n}_proj.weight", lambda t, j=j: t[:, j * d:(j + 1) * d].t()) for j, n in enumerate("qkv")]
        split_b = [(f"{b}attn.{n}_proj.bias", lambda t, j=j: t[j * d:(j + 1) * d]) for j, n in enumerate("qkv")]
        ps += [Param(f"{h}ln_1.weight", (d,), [(f"{b}ln_1.weight", same)]),
               Param(f"{h}ln_1.bias", (d,), [(f"{b}ln_1.bias", same)]),
               Param(f"{h}attn.c_attn.weight", (d, 3 * d), split), Param(f"{h}attn.c_attn.bias", (3 * d,), split_b),
               Param(f"{h}attn.c_proj.weight", (d, d), [(f"{b}attn.out_proj.weight", _t)]),
               Param(f"{h}attn.c_proj.bias", (d,), [(f"{b}attn.out_proj.bias", same)]),
               Param(f"{h}ln_2.weight", (d,), [(f"{b}ln_2.weight", same)]),
               Param(f"{h}ln_2.bias", (d,), [(f"{b}ln_2.bias", same)]),
               Param(f"{h}mlp.c_fc.weight", (d, hidden), [(f"{b}mlp.up_proj.weight", _t)]),
               Param(f"{h}mlp.c_fc.bias", (hidden,), [(f"{b}mlp.up_proj.bias", same)]),
               Param(f"{h}mlp.c_proj.weight", (hidden, d), [(f"{b}mlp.down_proj.weight", _t)]),
               Param(f"{h}mlp.c_proj.bias", (d,), [(f"{b}mlp.down_proj.bias", same)])]
    return ps


# HF norm names -> ours, by norm layout: the same HF name means another norm in another layout
# (Llama's post_attention_layernorm is the pre-MLP norm, Gemma 2's the norm of the attention's output)
NORM_NAMES = {"pre": {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2"},
              "sandwich": {"input_layernorm": "ln_1", "post_attention_layernorm": "post_attn_norm",
                           "pre_feedforward_layernorm": "ln_2", "post_feedforward_layernorm": "post_mlp_norm"},
              "post": {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"}}


def _plus_one(t):
    return 1.0 + t      # Gemma's RMSNorm multiplies by (1 + w) in fp32: we store that effective gain


def _rows(start: int, stop: int):
    return lambda t: t[start:stop]


def llama_params(f: ConfigFields, cfg: DecoderConfig) -> list[Param]:
    """The llama-like families use nn.Linear ([out, in]) with the decoder's own projection names; a fused
    family's (Phi-3's) qkv_proj / gate_up_proj are split by rows, Gemma's norm gains become 1 + w."""
    family = f.family
    d, hidden, q, kv = cfg.d_model, cfg.hidden, cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    gain = _plus_one if family.gain_plus_one else same
    ps = [Param("embed_tokens.weight", (cfg.vocab_size, d), [("wte.weight", same)]),
          Param("norm.weight", (d,), [("ln_f.weight", gain)])]
    for i in range(cfg.n_layer):
        h, b = f"layers.{i}.", f"blocks.{i}."
        norms = [(theirs, ours) for theirs, ours in NORM_NAMES[cfg.norm_layout].items()]
        if cfg.qk_norm:
            norms += [("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm")]
        ps += [Param(f"{h}{theirs}.weight", (cfg.norm_width(ours),), [(f"{b}{ours}.weight", gain)])
               for theirs, ours in norms]
        if family.fused:
            ps += [Param(f"{h}self_attn.qkv_proj.weight", (q + 2 * kv, d),
                         [(f"{b}attn.q_proj.weight", _rows(0, q)), (f"{b}attn.k_proj.weight", _rows(q, q + kv)),
                          (f"{b}attn.v_proj.weight", _rows(q + kv, q + 2 * kv))]),
                   Param(f"{h}mlp.gate_up_proj.weight", (2 * hidden, d),     # chunk(2): the gate first
                         [(f"{b}mlp.gate_proj.weight", _rows(0, hidden)),
                          (f"{b}mlp.up_proj.weight", _rows(hidden, 2 * hidden))])]
            projections = [("self_attn.o_proj", "attn.out_proj", (d, q), cfg.out_bias),
                           ("mlp.down_proj", "mlp.down_proj", (d, hidden), cfg.mlp_bias)]
        else:
            projections = [("self_attn.q_proj", "attn.q_proj", (q, d), cfg.qkv_bias),
                           ("self_attn.k_proj", "attn.k_proj", (kv, d), cfg.qkv_bias),
                           ("self_attn.v_proj", "attn.v_proj", (kv, d), cfg.qkv_bias),
                           ("self_attn.o_proj", "attn.out_proj", (d, q), cfg.out_bias),
                           ("mlp.gate_proj", "mlp.gate_proj", (hidden, d), cfg.mlp_bias),
                           ("mlp.up_proj", "mlp.up_proj", (hidden, d), cfg.mlp_bias),
                           ("mlp.down_proj", "mlp.down_proj", (d, hidden), cfg.mlp_bias)]
        for theirs, ours, shape, bias in projections:
            ps.append(Param(f"{h}{theirs}.weight", shape, [(f"{b}{ours}.weight", same)]))
            if bias:
                ps.append(Param(f"{h}{theirs}.bias", shape[:1], [(f"{b}{ours}.bias", same)]))
    return ps
