"""graph_passes.logits_from: the LM head of the positions [logits_from, T) only; every position by default."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from core.contract import LOGITS, LOGITS_FROM, ContractError, read_contract
from graph_passes.logits_from import TAIL_DIM, with_logits_from
from tests.graph_passes.fixtures import D, init, rng_mat, run

V = 11


def head_graph(softcap: bool) -> onnx.ModelProto:
    """x [B, T, D] -> Mul(gamma) -> MatMul(W) [-> Div, Tanh, Mul: Gemma 2's soft-cap] -> logits [B, T, V]."""
    nodes = [helper.make_node("Mul", ["x", "gamma"], ["normed"]),
             helper.make_node("MatMul", ["normed", "W"], ["y" if softcap else LOGITS])]
    if softcap:
        nodes += [helper.make_node("Div", ["y", "cap"], ["y_div"]), helper.make_node("Tanh", ["y_div"], ["y_tanh"]),
                  helper.make_node("Mul", ["y_tanh", "cap"], [LOGITS])]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D])],
                          [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["batch", "seq", V])],
                          initializer=[init("gamma", rng_mat(1, (D,))), init("W", rng_mat(2, (D, V))),
                                       init("cap", np.float32(3.0))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


@pytest.mark.parametrize("softcap", [False, True])
def test_logits_of_the_positions_asked_equal_the_full_graphs(softcap):
    x = np.random.default_rng(0).normal(size=(3, 7, D)).astype(np.float32)
    full = run(head_graph(softcap), {"x": x})[LOGITS]                                        # [3, 7, V]
    cut = with_logits_from(head_graph(softcap))
    onnx.checker.check_model(cut, full_check=True)
    assert [n.op_type for n in cut.graph.node][:3] == ["Mul", "Slice", "MatMul"]            # before the head, after the norm
    assert cut.graph.output[0].type.tensor_type.shape.dim[1].dim_param == TAIL_DIM
    np.testing.assert_array_equal(run(cut, {"x": x})[LOGITS], full)                          # not fed: every position
    for k in (0, 1, 6):
        got = run(cut, {"x": x, LOGITS_FROM: np.array([k], np.int64)})[LOGITS]
        assert got.shape == (3, 7 - k, V)
        np.testing.assert_array_equal(got, full[:, k:])


def test_a_graph_without_a_head_or_with_the_input_already_is_refused():
    g = helper.make_graph([helper.make_node("Relu", ["x"], [LOGITS])], "no_head",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, V])],
                          [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [1, 2, V])])
    with pytest.raises(ValueError, match="head .*found Relu"):
        with_logits_from(helper.make_model(g))
    with pytest.raises(ValueError, match="takes logits_from already"):
        with_logits_from(with_logits_from(head_graph(False)))


def test_the_contract_reads_logits_from_and_refuses_another_type():
    ins = {"input_ids": (["b", "t"], "int64"), "position": (["b"], "int64"), "key_0": (["b", 2, 8, 4], "fp32"),
           "value_0": (["b", 2, 8, 4], "fp32")}
    outs = {LOGITS: (["b", "t", V], "fp32"), "present_key_0": (["b", 2, 8, 4], "fp32"),
            "present_value_0": (["b", 2, 8, 4], "fp32")}
    assert not read_contract("g", ins, outs).takes_logits_from
    assert read_contract("g", {**ins, LOGITS_FROM: ([1], "int64")}, outs).takes_logits_from
    with pytest.raises(ContractError, match="expected logits_from int64 \\[1\\], found logits_from fp32"):
        read_contract("g", {**ins, LOGITS_FROM: ([1], "fp32")}, outs)
