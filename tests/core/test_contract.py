"""core.contract: the decode-step contract reader and ONNX file checks."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.contract import ContractError, contract_of, load_onnx, read_contract


def _io(n_layer=2, h=2, s=16, d=4, vocab=10, dt=1):
    ins = {"input_ids": (["b", "t"], 7), "position": (["b"], 7)}
    outs = {"logits": (["b", "t", vocab], dt)}
    for i in range(n_layer):
        for k in ("key", "value"):
            ins[f"{k}_{i}"] = (["b", h, s, d], dt)
            outs[f"present_{k}_{i}"] = (["b", h, s, d], dt)
    return ins, outs


def test_reads_the_contract():
    c = read_contract("g", *_io())
    assert (c.n_layer, c.n_kv_head, c.capacity, c.head_dim, c.vocab_size, c.dtype) == (2, 2, 16, 4, 10, "fp32")
    assert c.cache_names() == ["key_0", "value_0", "key_1", "value_1"]
    assert c.cache_bytes(3) == 2 * 2 * 3 * 2 * 16 * 4 * 4


@pytest.mark.parametrize("mutate, needle", [
    (lambda i, o: i.pop("position"), "input 'position'"),
    (lambda i, o: o.pop("present_value_1"), "present_value_1"),
    (lambda i, o: i.update(key_0=(["b", None, 16, 4], 1)), "static H, S_max, D"),
    (lambda i, o: i.update(key_1=(["b", 2, 8, 4], 1)), "every cache like key_0"),
    (lambda i, o: o.update(logits=(["b", "t", None], 1)), "static vocabulary axis"),
    (lambda i, o: i.update(input_ids=(["b", "t"], 6)), "int64"),
])
def test_refuses_what_is_not_the_contract(mutate, needle):
    ins, outs = _io()
    mutate(ins, outs)
    with pytest.raises(ContractError, match=needle) as e:
        read_contract("g.onnx", ins, outs)
    assert "\n" not in str(e.value) and str(e.value).startswith("g.onnx: expected")


def _tiny_model():
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    return helper.make_model(g)


def test_load_onnx_names_each_broken_file(tmp_path):
    with pytest.raises(ContractError, match="no such file"):
        load_onnx(tmp_path / "none.onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ContractError, match="empty file"):
        load_onnx(tmp_path / "empty.onnx")
    good = tmp_path / "m.onnx"
    onnx.save(_tiny_model(), good)
    (tmp_path / "trunc.onnx").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ContractError, match="truncated or not ONNX|no graph"):
        load_onnx(tmp_path / "trunc.onnx")
    ext = tmp_path / "ext" / "m.onnx"
    ext.parent.mkdir()
    onnx.save(_tiny_model(), ext, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert load_onnx(ext).graph.initializer[0].name == "w"
    (ext.parent / "m.onnx.data").unlink()
    with pytest.raises(ContractError, match="external-data file m.onnx.data, not found"):
        load_onnx(ext)
    with pytest.raises(ContractError, match="found a directory"):
        load_onnx(tmp_path)


def test_contract_of_a_non_decoder_graph(tmp_path):
    onnx.save(_tiny_model(), tmp_path / "m.onnx")
    with pytest.raises(ContractError, match="input 'input_ids'"):
        contract_of(tmp_path / "m.onnx")
