"""The memory model of a build: its peak resident bytes, by what is alive at its largest moment, estimated
before any work from the model's config (export.pipeline refuses in one line when it cannot fit, naming a
cheaper option that would). The factors were measured on Llama-3.2-1B- and Llama-3-8B-shaped builds
(docs/export.md, "Real sizes").
"""
from __future__ import annotations

from dataclasses import dataclass

from core.inputs import human_bytes

GIB = 1 << 30
BASE_BYTES = int(1.5 * GIB)      # interpreter, torch, onnx and ONNX Runtime loaded, allocator slack (measured)


@dataclass
class MemoryEstimate:
    """Peak resident bytes of a build, by what is alive at its largest moment."""
    peak: int
    parts: dict[str, int]

    def line(self) -> str:
        big = max(self.parts, key=self.parts.get)
        return f"~{human_bytes(self.peak)} at its peak ({big}: {human_bytes(self.parts[big])})"

    def to_json(self) -> dict:
        """report.json's memory_estimate: the peak and its parts, bytes."""
        return {"peak_bytes": self.peak, **self.parts}


def graph_weight_bytes(cfg, dtype: str, quantize) -> int:
    """Bytes of the weights in the written graph."""
    params = cfg.approx_param_count()
    if quantize is None:
        return params * (4 if dtype == "fp32" else 2)
    per_value = {4: 0.5, 8: 1.0}[quantize.bits] + 4 / quantize.block_size        # data + one fp32 scale a block
    head = cfg.vocab_size * cfg.d_model
    head_bytes = head * ({"int8": 1.0 + 4 / quantize.block_size, "int4": per_value, "fp32": 4.0}[quantize.head_dtype])
    return int((params - head) * per_value + head_bytes)


VERIFY_BATCH = 2         # rows of export.conventions.session_steps, the verification's sessions


def cache_bytes(cfg, dtype: str, batch: int) -> int:
    """Bytes of one set of KV caches (every layer's keys and values) at the model's full capacity, fp32 but for
    an fp16 graph's (a bf16 graph is verified widened)."""
    per_value = 2 if dtype == "fp16" else 4
    return 2 * cfg.n_layer * batch * cfg.kv_heads * cfg.max_seq_len * cfg.head_dim * per_value


def build_memory(cfg, dtype: str, quantize) -> MemoryEstimate:
    """The build's peak: the largest of its stages, each alone (export/pipeline.py frees each stage's
    memory before the next: only one model is alive at a time)."""
    d, hidden, v = cfg.d_model, cfg.hidden, cfg.vocab_size
    block = 4 * (d * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.kv_heads) + (3 if cfg.mlp == "swiglu" else 2) * d * hidden)
    table = 4 * v * d
    parts = {
        # one weight at a time: read (fp32), transposed, folded in float64, cast or quantized
        "writing a weight": 4 * table,
        # the reference holds one block, the table and the head; a quantized graph's reference also the
        # dequantized copies of both tables
        "the torch reference": 2 * block + 2 * table + (2 * table if quantize is not None else 0),
        # ONNX Runtime's share, measured: GPT-2 medium's fp32 graph (1.6 GB; MatMul weights prepacked)
        # peaked at 3.6 GB, Llama-3.2-1B's (6.0 GB) at 6.6 GB: up to ~1.5 x the graph plus the base; and a
        # verification step's caches at full capacity, in and out (GroupQueryAttention copies the whole past
        # into a present of its own): Qwen3-0.6B's int4 build at 8448 tokens, 3.9 GB a set of 2 rows, peaked
        # at 8.3 GiB in this stage against an estimate of 3.9 GiB without them
        "ONNX Runtime over the graph": int(1.5 * graph_weight_bytes(cfg, dtype, quantize))
                                       + 2 * cache_bytes(cfg, dtype, VERIFY_BATCH),
    }
    return MemoryEstimate(BASE_BYTES + max(parts.values()), parts)


def transformers_check_bytes(cfg) -> int:
    """The peak of the transformers check (transformers_check): transformers' model whole, 8 bytes a parameter
    (its float64 rerun past the fixed tolerance converts it in place; ours is the block-by-block reference), on
    top of BASE_BYTES; it runs after the build's own stages have released theirs."""
    return BASE_BYTES + 2 * 4 * cfg.approx_param_count()


def cheaper_option(cfg, dtype: str, quantize) -> str:
    """What would fit: the first of int4, int8, fp16 whose estimate is lower and fits."""
    from core.inputs import available_memory      # looked up when called: tests replace it
    from export.quantize import QuantConfig
    avail = available_memory() or 0
    for label, d, q in (("--quantize int4", "fp32", QuantConfig("int4")), ("--quantize int8", "fp32", QuantConfig("int8")),
                        ("--dtype fp16", "fp16", None)):
        if (label.endswith("fp16") and dtype in ("fp16", "bf16")) or (q is not None and quantize is not None and q.bits >= quantize.bits):
            continue
        peak = build_memory(cfg, d, q).peak
        if peak <= avail:
            return f"build with {label} (needs ~{human_bytes(peak)})"
    return "use a machine with more memory"
