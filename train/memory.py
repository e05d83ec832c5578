"""Memory one rank needs for a training step, estimated before the first one, and the refusal when it
cannot fit.

    est = estimate_rank_memory(cfg, micro_batch=2, seq_len=2048, world=8, fsdp=True, dtype="bf16",
                               checkpoint=True)
    est.total, est.describe()         # parameters, gradients, optimizer, activations (bytes)

Torch-free (the figures in docs/training.md come from this on any machine). The terms:
  parameters   fp32 master weights: all of them (DDP) or 1/N (FSDP), plus under FSDP the groups
               all-gathered in the compute dtype at once (the root group, which holds the embedding
               when it is tied, and two blocks: the one computing and the one prefetched)
  gradients    fp32, the same shares; DDP keeps a second copy in its all-reduce buckets, FSDP the
               unsharded gradients of the groups being reduce-scattered
  optimizer    AdamW's two fp32 moments of the parameters the rank holds
  activations  what backward keeps, per micro-batch on the rank: per block and token the norms'
               inputs and outputs, q/k/v, attention output, the MLP's hidden tensors, plus the
               attention probabilities (n_head x seq_len per token: the plain attention of
               models/attention.py stores them); with --checkpoint-activations only each block's input
               and one block's full set during its recompute; then the logits (compute dtype, their
               fp32 copy for the loss and its softmax)
  loading      before the first step: DDP builds the whole fp32 model and reads the source whole beside
               it (two copies); --fsdp builds its fp32 shards and at most one whole tensor (the largest:
               the embedding or head table) while it reads or draws it (train/sharded.py). Not added to
               the step's terms (loading ends before the step starts): the refusal compares the larger.
"""
from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}
# blocks whose parameters FSDP holds gathered at once: the one computing and the one prefetched
GATHERED_BLOCKS = 2


@dataclass(frozen=True)
class RankMemory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    loading: int = 0

    @property
    def total(self) -> int:
        """One step's memory."""
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def peak(self) -> int:
        """The most at any point: a step, or loading the model before it."""
        return max(self.total, self.loading)

    def describe(self) -> str:
        from core.inputs import human_bytes
        parts = ", ".join(f"{k} {human_bytes(getattr(self, k))}"
                          for k in ("parameters", "gradients", "optimizer", "activations"))
        return f"{human_bytes(self.total)} ({parts}; loading {human_bytes(self.loading)})"


def block_params(cfg) -> int:
    """Parameters of one decoder block (as DecoderConfig.approx_param_count counts them)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * hd * (2 * cfg.n_head + 2 * cfg.kv_heads)
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.hidden
    return attn + mlp + 8 * d + cfg.hidden


def activation_bytes(cfg, micro_batch: int, seq_len: int, dtype: str, checkpoint: bool) -> int:
    e = COMPUTE_BYTES[dtype]
    tokens = micro_batch * seq_len
    kv = cfg.kv_heads * cfg.head_dim
    hidden_tensors = 4 if cfg.mlp == "swiglu" else 2       # (gate, act, up, product) or (up, act)
    per_token = (8 * cfg.d_model + 2 * kv + hidden_tensors * cfg.hidden + 2 * cfg.n_head * seq_len) * e
    block = tokens * per_token
    blocks = cfg.n_layer * tokens * cfg.d_model * e + block if checkpoint else cfg.n_layer * block
    head = tokens * (2 * cfg.d_model * e + cfg.vocab_size * (e + 2 * FP32))
    return blocks + head


def estimate_rank_memory(cfg, micro_batch: int, seq_len: int, world: int, fsdp: bool, dtype: str = "fp32",
                         checkpoint: bool = False) -> RankMemory:
    """The memory of one rank for one step; cfg: a models.decoder.DecoderConfig."""
    total = cfg.approx_param_count()
    acts = activation_bytes(cfg, micro_batch, seq_len, dtype, checkpoint)
    if not fsdp:
        return RankMemory(FP32 * total, 2 * FP32 * total, 2 * FP32 * total, acts, loading=2 * FP32 * total)
    e = COMPUTE_BYTES[dtype]
    root = total - cfg.n_layer * block_params(cfg)                       # embeddings, head, final norm
    if not cfg.tie_embeddings:   # embedding and head are groups of their own: the larger one at a time
        root -= cfg.vocab_size * cfg.d_model
    gathered = root + GATHERED_BLOCKS * block_params(cfg)
    share = -(-total // world)
    largest = max(cfg.vocab_size * cfg.d_model, cfg.hidden * cfg.d_model)   # one whole tensor while it is read
    return RankMemory(FP32 * share + e * gathered, FP32 * share + FP32 * gathered, 2 * FP32 * share, acts,
                      loading=FP32 * (share + largest))
