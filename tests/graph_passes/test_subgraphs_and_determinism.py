"""The driver: If/Loop bodies are walked like the main graph; the output is deterministic and idempotent."""
import numpy as np
import pytest

from graph_passes import run_passes
from tests.graph_passes.fixtures import assert_same, exploded_rmsnorm, merged_decoder, ops, scale_to_linears, x_feed


def _all_ops(m):
    out = []
    for n in m.graph.node:
        out.append(n.op_type)
        for a in n.attribute:
            if a.g.node:
                out += [k.op_type for k in a.g.node]
    return out


def test_merged_decoder_is_folded_in_both_branches():
    m = merged_decoder()
    fused, results = run_passes(m)
    folded = {w for r in results for w, _ in r.rewrites}
    assert {"norm_a", "norm_b"} <= folded
    assert "Mul" not in _all_ops(fused) and _all_ops(fused).count("MatMul") == 2
    for branch in (True, False):
        assert_same(m, fused, {**x_feed(), "use_cache_branch": np.array([branch])})


@pytest.mark.parametrize("build", [merged_decoder, exploded_rmsnorm, lambda: scale_to_linears(shift=np.ones(8, np.float32))],
                         ids=["merged", "exploded-rmsnorm", "taper"])
def test_same_input_gives_byte_identical_output_and_a_rerun_changes_nothing(build):
    m = build()
    first, _ = run_passes(m)
    second, _ = run_passes(m)
    assert first.SerializeToString() == second.SerializeToString()
    again, results = run_passes(first)
    assert [r.rewrites for r in results if r.name != "trt_lint"] == [[] for r in results if r.name != "trt_lint"]
    assert again.SerializeToString() == first.SerializeToString()
