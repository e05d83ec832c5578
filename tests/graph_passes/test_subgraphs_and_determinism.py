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


def test_a_scale_read_from_inside_a_branch_is_left_alone():
    """y = x * s in the main graph, y @ W inside an If branch: the fold would cross scopes."""
    from onnx import TensorProto, helper
    from tests.graph_passes.fixtures import init, model, rng_mat, rng_vec
    branch = lambda tag: helper.make_graph([helper.make_node("MatMul", ["h", "W"], [f"y_{tag}"], name=f"proj_{tag}")],
                                           tag, [], [helper.make_tensor_value_info(f"y_{tag}", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"], name="norm"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch("a"), else_branch=branch("b"))]
    m = model(nodes, [init("s", rng_vec(1)), init("W", rng_mat(2))])
    m.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, [1]))
    fused, results = run_passes(m, ["channel_scale"])
    assert results[0].rewrites == [] and "from inside a subgraph" in results[0].notes[0]
    assert_same(m, fused, {**x_feed(), "c": np.array([True])})
