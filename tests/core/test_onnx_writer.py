"""core.onnx_writer: byte counts on graphs built in code (no exporter); a graph and its weights replaced together."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from core.onnx_writer import data_file_name, initializer_bytes, replaced_graph_in


def _graph():
    """E [8, 4] read by Gather only (a lookup table), W [4, 4] by MatMul, T [8, 4] by Gather and MatMul (tied)."""
    inits = [numpy_helper.from_array(np.zeros((8, 4), np.float32), n) for n in ("E", "T")]
    inits.append(numpy_helper.from_array(np.zeros((4, 4), np.float32), "W"))
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("Gather", ["T", "ids"], ["t"]),
             helper.make_node("MatMul", ["e", "W"], ["h"]), helper.make_node("MatMul", ["h", "T"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g)


def test_per_step_bytes_leave_out_tables_read_only_by_lookups():
    proto = _graph()
    assert initializer_bytes(proto) == (32 + 32 + 16) * 4
    assert initializer_bytes(proto, per_step=True) == (32 + 16) * 4       # E is read a row a token


def _save_external(proto, path):
    import onnx
    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=data_file_name(path), size_threshold=0)


def test_replaced_graph_in_swaps_the_graph_and_its_weights_file_together(tmp_path):
    """A graph with its `.data` beside it (bench's build cache): both replace the earlier pair, the graph
    names its own weights' file, and a failed write leaves the earlier pair and no temporary behind."""
    import onnx
    import pytest
    from core.outputs import BENCH_CACHE, claim_dir
    cache = claim_dir(tmp_path / "cache", BENCH_CACHE)
    for value in (1.0, 2.0):
        proto = _graph()
        proto.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.full((4, 4), value, np.float32), "W"))
        with replaced_graph_in(cache, "m.onnx") as tmp:
            _save_external(proto, tmp)
    with pytest.raises(RuntimeError):
        with replaced_graph_in(cache, "m.onnx") as tmp:
            _save_external(_graph(), tmp)
            raise RuntimeError("a refused graph")
    loaded = onnx.load(str(cache / "m.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    assert (weights["W"] == 2.0).all()
    assert sorted(p.name for p in cache.iterdir()) == sorted([".tapernorm-output.json", "m.onnx", "m.onnx.data"])
