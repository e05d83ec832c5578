"""Presets (what is trained) and sizes (how big, and the default schedule for that size).

| preset             | norms in blocks | final norm        | scale anchor                  |
|--------------------|-----------------|-------------------|-------------------------------|
| baseline           | RMSNorm         | RMSNorm           | the final norm                |
| internal-taper     | TaperNorm       | RMSNorm (real)    | the final norm (implicit)     |
| all-taper          | TaperNorm       | TaperNorm         | fixed-target scale loss L_aux |
| all-taper-noanchor | TaperNorm       | none              | none (shows logit chasing)    |
| dyt                | DyT             | DyT               | none needed (tanh saturates)  |
| layernorm          | LayerNorm       | LayerNorm         | the final norm                |

`layernorm` is GPT-2's architecture (LayerNorm, learned positions, tanh GELU, biases,
tied head): the model train.finetune's TaperLN and FakeLN methods start from.

Architectures (`--arch`; the preset decides the norms, the architecture where they sit and
the rest of the block):

| arch   | positions, MLP                          | norms                                          |
|--------|-----------------------------------------|------------------------------------------------|
| gpt2   | learned table, GELU MLP, biases (default) | pre-norms                                    |
| llama  | rope, SwiGLU, grouped-query, no biases  | pre-norms                                      |
| qwen3  | llama's                                 | pre-norms, QK-norm per head                    |
| gemma3 | llama's with GeGLU, embeddings x sqrt(d), sliding-window layers (3 : 1, the last global) with a local rope base | sandwich (pre and post), QK-norm per head |
"""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    "baseline": dict(model=dict(norm="rmsnorm"), aux=False),
    "internal-taper": dict(model=dict(norm="taper", taper_scope="internal"), aux=False),
    "all-taper": dict(model=dict(norm="taper", taper_scope="all"), aux=True),
    "all-taper-noanchor": dict(model=dict(norm="taper", taper_scope="all", final_norm=False), aux=False),
    # DyT has no normalization to lift the std-0.02 embeddings to unit scale: with alpha 0.5 its
    # outputs start at ~0.01 and training sits on the unigram plateau (val loss 5.3 for 300+ steps
    # at tiny size). As the DyT recipe for LLMs scales the embeddings up (by sqrt(d)), the preset
    # starts the embeddings at std 0.2 and alpha at 1.0: alpha * x starts at ~0.3.
    "dyt": dict(model=dict(norm="dyt", dyt_alpha_init=1.0), aux=False, embed_std=0.2),
    "layernorm": dict(model=dict(norm="layernorm"), aux=False),
}

# Defaults per size. tiny: ~1.1M parameters; one run is ~7 min on one core of the
# project's 2-core CPU machine (0.35 s per step at batch 16 x 128, single thread).
SIZES: dict[str, dict] = {
    "tiny": dict(model=dict(d_model=128, n_layer=4, n_head=4, vocab_size=2048, max_seq_len=256),
                 steps=1200, batch_size=16, seq_len=128, lr=2e-3, eval_every=100),
    "small": dict(model=dict(d_model=256, n_layer=10, n_head=8, vocab_size=2048, max_seq_len=256),
                  steps=4000, batch_size=32, seq_len=256, lr=1e-3, eval_every=200),
}

ARCHS = ("gpt2", "llama", "qwen3", "gemma3")
GEMMA3_WINDOW = 32          # tiny models train on 128-token windows: a 32-key window is a real restriction


def architecture(name: str, d_model: int, n_layer: int, n_head: int) -> dict:
    """The DecoderConfig fields of architecture `name` at this width and depth (see the table above)."""
    if name == "gpt2":
        return {}
    llama = dict(pos_embedding="rope", mlp="swiglu", qkv_bias=False, out_bias=False, mlp_bias=False,
                 n_kv_head=max(1, n_head // 2), rope_theta=500000.0)
    if name == "llama":
        return llama
    if name == "qwen3":
        return {**llama, "rope_theta": 1e6, "qk_norm": "head"}
    sliding = [i for i in range(n_layer - 1) if (i + 1) % 4]             # Gemma 3's local : global, every 4th global
    return {**llama, "rope_theta": 1e6, "activation": "gelu_new", "norm_layout": "sandwich", "qk_norm": "head",
            "embed_scale": d_model ** 0.5, "sliding_window": GEMMA3_WINDOW, "sliding_layers": sliding,
            "local_rope_theta": 10000.0}


WARMUP_FRAC = 0.35  # default warmup steps = 35% of the run
TAPER_FRAC = 0.35   # default taper steps = 35%; the last 30% train at g = 0
