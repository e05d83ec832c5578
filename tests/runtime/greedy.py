"""Comparing greedy token streams from two backends, with ties handled explicitly.

Two backends compute the same logits up to float rounding (~1e-6 relative). Where
the top two logits of a step are closer than TIE_GAP, rounding may pick either
token, and after a different token the two sequences legitimately diverge. So:
tokens must be equal step by step; at the first difference, the reference's top-2
gap at that step must be below TIE_GAP (a tie), and comparison of that sequence
stops there (reported, so a test can require most of the stream was compared).
"""
from __future__ import annotations

import numpy as np

TIE_GAP = 1e-4   # fp32 logits of the zoo models are O(10); backends agree to ~1e-5


def top2_gap(logits: np.ndarray) -> float:
    two = np.sort(logits.astype(np.float64))[-2:]
    return float(two[1] - two[0])


def compare_greedy(ref_tokens: list[int], ref_logits: list[np.ndarray], other_tokens: list[int],
                   other_logits: list[np.ndarray] | None = None) -> int:
    """Number of tokens compared equal; raises AssertionError at a difference that is not a tie.

    ref_logits[i] is the [V] logits row the reference picked ref_tokens[i] from.
    """
    n = min(len(ref_tokens), len(other_tokens))
    for i in range(n):
        if ref_tokens[i] != other_tokens[i]:
            gaps = [top2_gap(ref_logits[i])] + ([top2_gap(other_logits[i])] if other_logits else [])
            assert min(gaps) < TIE_GAP, (
                f"token {i}: {ref_tokens[i]} vs {other_tokens[i]} with a top-2 logit gap of {min(gaps):.3g} "
                f">= {TIE_GAP} (not a tie); streams so far {ref_tokens[:i + 1]} vs {other_tokens[:i + 1]}")
            return i   # a tie: the streams may diverge from here
    assert len(ref_tokens) == len(other_tokens), f"lengths {len(ref_tokens)} vs {len(other_tokens)} with equal tokens"
    return n
