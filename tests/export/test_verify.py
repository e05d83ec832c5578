"""export.verify: one typed error listing every mismatch; the CLI users run in CI."""
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from export.verify import VerificationError, compare
from tests.export.exported import exported, save


def test_compare_lists_every_mismatch_in_one_error():
    ref = [{"logits": np.zeros((1, 2, 3), np.float32), "present_key_0": np.zeros(4, np.float32)}]
    got = [{"logits": np.full((1, 2, 3), 3e-3, np.float32), "present_key_0": np.full(4, 1.0, np.float32)}]
    with pytest.raises(VerificationError) as e:
        compare(ref, got, "fp32", "a vs b")
    # fp32: atol plus 2e-6 x the largest |reference| value (0 here)
    bound = "tolerance 0.0001 (atol 0.0001 + 2e-06 x max |ref| 0)"
    assert e.value.mismatches == [f"logits: max abs diff 0.003 > {bound}", f"present_key_0: max abs diff 1 > {bound}"]
    assert str(e.value).splitlines()[1] == f"- logits: max abs diff 0.003 > {bound}"


def test_compare_flags_nan_shape_and_missing_outputs():
    ref = [{"logits": np.zeros(3, np.float32), "present_key_0": np.zeros(2, np.float32), "x": np.zeros(1)}]
    got = [{"logits": np.array([0, np.nan, 0], np.float32), "present_key_0": np.zeros(3, np.float32)}]
    with pytest.raises(VerificationError) as e:
        compare(ref, got, "fp32", "a vs b")
    text = "\n".join(e.value.mismatches)
    assert "logits: max abs diff inf" in text and "present_key_0: shape [3]" in text and "x: missing" in text


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "export.verify", *map(str, args)], capture_output=True, text=True)


def test_cli_equal_on_fused_vs_unfused_and_not_equal_on_one_perturbed_weight():
    _, proto, fused, _ = exported("internal-taper")
    a, b = save(proto, "verify_a.onnx"), save(fused, "verify_b.onnx")
    from tests.helpers import tiny_tokenizer_json
    tok = tiny_tokenizer_json(a.parent / "tok" / "tokenizer.json")
    ok = _cli(a, b, "--tokenizer", tok)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "real tokens:" in ok.stdout and "EQUAL" in ok.stdout

    bad = onnx.ModelProto()
    bad.CopyFrom(fused)
    # perturb one weight: the last 2-D MatMul weight of the fused graph (the LM head)
    w_name = [n.input[1] for n in bad.graph.node if n.op_type == "MatMul"
              and any(i.name == n.input[1] and len(i.dims) == 2 for i in bad.graph.initializer)][-1]
    init = next(i for i in bad.graph.initializer if i.name == w_name)
    w = numpy_helper.to_array(init).copy()
    w[:, 0] += 0.5
    init.CopyFrom(numpy_helper.from_array(w, w_name))
    c = save(bad, "verify_bad.onnx")
    ko = _cli(a, c)
    assert ko.returncode == 1, ko.stdout + ko.stderr
    assert ": logits: max abs diff" in ko.stdout and "NOT EQUAL" in ko.stdout


def test_cli_interface_mismatch_and_missing_file(tmp_path):
    _, proto, _, _ = exported("internal-taper")
    other = onnx.ModelProto()
    other.CopyFrom(proto)
    for v in list(other.graph.input) + list(other.graph.output):       # another cache capacity
        if "key_" in v.name or "value_" in v.name:
            v.type.tensor_type.shape.dim[2].dim_value += 1
    r = _cli(save(proto, "iface_a.onnx"), save(other, "iface_b.onnx"))
    assert r.returncode == 1 and "interfaces" in r.stdout and "input key_0" in r.stdout
    r = _cli(tmp_path / "nope.onnx", tmp_path / "nope2.onnx")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "no such file" in r.stderr


def test_a_failed_verification_lists_each_mismatch_once_on_the_command_line(capsys):
    from core.lifecycle import run_cli

    def fails(argv):
        raise VerificationError("model.onnx vs torch", ["logits: max abs diff 1 > atol 0.0001", "present_key_0: nan"])
    assert run_cli(fails, []) != 0
    assert capsys.readouterr().err.splitlines() == ["error: export verification failed (model.onnx vs torch):",
                                                    "- logits: max abs diff 1 > atol 0.0001", "- present_key_0: nan"]
