"""An ONNX file names where its external data lives; a location outside the model's folder (absolute,
escaping with '..', or a link that leads out) would make opening a model read any file the user can.
Every loader of a user's ONNX file refuses it with one line (core.contract.check_external_data),
before anything opens or measures that file; locations inside the folder keep working."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.contract import ContractError, contract_of, load_onnx
from core.errors import UserError
from tests.cli.conftest import cli

WEIGHTS = np.arange(4, dtype=np.float32)


def _external(name: str, location: str, length: int = WEIGHTS.nbytes) -> onnx.TensorProto:
    t = numpy_helper.from_array(np.zeros(4, np.float32), name)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _model(path, location: str, where: str = "initializer", length: int = WEIGHTS.nbytes):
    """y = x + w with w's data at `location`: a main-graph initializer, a Constant node's value, or an
    initializer of an If node's branch."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    w = _external("w", location, length)
    inits, nodes = [], []
    if where == "initializer":
        inits = [w]
    elif where == "constant":
        nodes = [helper.make_node("Constant", [], ["w"], value=w)]
    else:                                    # both branches read w from their own initializer
        branch = helper.make_graph([helper.make_node("Identity", ["wb"], ["w_out"])], "b", [],
                                   [helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [4])],
                                   [_external("wb", location, length)])
        cond = numpy_helper.from_array(np.array(True), "cond")
        inits = [cond]
        nodes = [helper.make_node("If", ["cond"], ["w"], then_branch=branch, else_branch=branch)]
    graph = helper.make_graph([*nodes, helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], inits)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


@pytest.fixture
def outside(tmp_path):
    """A file beside the model's folder (what an escaping location reaches) and a link to it from inside."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(WEIGHTS.tobytes())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "link.bin").symlink_to(secret)
    return secret


ESCAPES = ["/etc/passwd", "../secret.bin", "sub/../../secret.bin", "link.bin"]


@pytest.mark.parametrize("location", ESCAPES)
@pytest.mark.parametrize("where", ["initializer", "constant", "subgraph"])
def test_load_onnx_refuses_a_location_outside_the_folder(tmp_path, outside, location, where):
    path = _model(tmp_path / "model" / "m.onnx", location, where, length=1 << 30)   # "truncated" was the old report
    for load in (load_onnx, lambda p: load_onnx(p, load_weights=False), contract_of):
        with pytest.raises(ContractError) as e:
            load(path)
        text = str(e.value)
        assert "\n" not in text and text.startswith(f"{path}: expected external-data locations inside")
        assert repr(location) in text and "truncated" not in text


def test_locations_inside_the_folder_still_load(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    for location in ("w.bin", "sub/w.bin", "sub/../w.bin"):
        (folder / location).write_bytes(WEIGHTS.tobytes())
        proto = load_onnx(_model(folder / "m.onnx", location))
        assert np.array_equal(numpy_helper.to_array(proto.graph.initializer[0]), WEIGHTS)


def _ort_session(path):
    from runtime.ort_session import OrtSession
    OrtSession(path).activate()


def _plain_ort_runner(path):
    from bench.runners import PlainOrtRunner
    PlainOrtRunner(str(path), threads=1, weight_bytes=0).activate()


def _verify_session(path):
    from export.verify import ort_session
    ort_session(path)


def _triton_controls(path):
    from runtime.triton.repository import add_control_inputs
    add_control_inputs(path, path.with_name("with_controls.onnx"))


@pytest.mark.parametrize("open_model", [_ort_session, _plain_ort_runner, _verify_session, _triton_controls])
@pytest.mark.parametrize("location", ["/etc/passwd", "../secret.bin"])
def test_every_loader_refuses_it_in_one_line(tmp_path, outside, open_model, location):
    path = _model(tmp_path / "model" / "m.onnx", location)
    with pytest.raises(UserError) as e:
        open_model(path)
    assert "\n" not in str(e.value) and "expected external-data locations inside" in str(e.value)
    assert not path.with_name("with_controls.onnx").exists()


def test_graph_passes_cli_refuses_it_in_one_line(tmp_path, outside):
    path = _model(tmp_path / "model" / "m.onnx", "../secret.bin")
    r = cli("graph_passes", [path, "-o", tmp_path / "out.onnx"])
    assert r.code == 1 and len(r.error_lines) == 1 and "Traceback" not in r.err, r.err
    assert "expected external-data locations inside" in r.error_lines[0] and "'../secret.bin'" in r.error_lines[0]
    assert not (tmp_path / "out.onnx").exists()


def test_check_external_data_passes_a_model_without_external_data(tmp_path):
    proto = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(WEIGHTS, "w")]))
    __import__("core.contract").contract.check_external_data(proto, tmp_path / "m.onnx")
