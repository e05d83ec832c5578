"""The acceptance targets bench.report judges a run against: data, each with where it came from.

A target is a threshold on one figure the report computes (a median ratio, a bandwidth
share), over the sizes it names. bench.report holds how each figure is read from a run;
the numbers, and the issue that set them, live here, so a new issue's targets are a new
table row, not an edit of the report's code.
"""
from __future__ import annotations

from dataclasses import dataclass

DECODE_ISSUE = ("the decode-benchmark issue (bench.decode's first version, commit c0f5389, 2026-11-29; "
                "judged in docs/bench.md, 'The issue's acceptance figures')")
GENAI_ISSUE = "issue 13 (the ONNX Runtime GenAI peers; judged in docs/bench.md, 'The issue's speed targets')"


@dataclass(frozen=True)
class Target:
    threshold: float                   # the figure must be >= this
    sizes: tuple[str, ...]             # the bench sizes (bench.variants.SIZES) it is judged at
    label: str                         # how the criterion names the sizes
    source: str                        # where the number came from


TARGETS: dict[str, Target] = {
    # our ort runtime (the rmsnorm-strong graph) over HF generate, median per-round ratio
    "ort_over_hf_small": Target(3.0, ("1M", "8M", "30M"), "<= 30M", DECODE_ISSUE),
    "ort_over_hf_124m": Target(2.3, ("124M",), "124M", DECODE_ISSUE),
    # achieved weight bandwidth / the best measured read bandwidth, ort, batch 1, rmsnorm-strong
    "bandwidth_share": Target(0.85, ("124M",), "124M", DECODE_ISSUE),
    # internal-taper fused: its ratio over rmsnorm-strong / its profiled limit (and never slower beyond noise)
    "fused_share_of_limit": Target(0.9, (), "every cell", DECODE_ISSUE),
    # torch eager internal-taper fused over rmsnorm-strong, median per-round ratio
    "torch_fused_over_strong": Target(1.25, ("1M",), "~1M", DECODE_ISSUE),
    # ours (internal-taper fused) over GenAI of the same dtype, batch 1
    "ours_over_genai": Target(1.1, ("30M", "124M"), "30M and 124M", GENAI_ISSUE),
    # ours fp32 (internal-taper fused) over the plain ORT loop and over GenAI fp32, batch 1
    "ours_over_plain_small": Target(1.0, ("1M", "8M"), "1M and 8M", GENAI_ISSUE),
}
