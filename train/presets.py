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

WARMUP_FRAC = 0.35  # default warmup steps = 35% of the run
TAPER_FRAC = 0.35   # default taper steps = 35%; the last 30% train at g = 0
