"""export.build --target: which graph the default build writes, and the contradictions refused."""
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import UsageError
from export import target as target_module
from export.target import Target, resolve_target
from models.decoder import DecoderConfig

ROOT = Path(__file__).resolve().parents[2]
LEARNED = DecoderConfig()                                                   # head size 32, learned positions
TINY_ROPE = DecoderConfig(d_model=32, n_head=4, pos_embedding="rope")       # head size 8 (tiny HF Llama tests)
PARTIAL_ROPE = DecoderConfig(d_model=128, n_head=4, pos_embedding="rope", rotary_dim=16)


@pytest.fixture
def no_tensorrt(monkeypatch):
    real = target_module.importlib.util.find_spec
    monkeypatch.setattr(target_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorrt" else real(name, *a))


def test_auto_is_the_ort_cpu_graph_where_it_can_be_built(no_tensorrt):
    t = resolve_target("auto", None, True, "fp32", False, LEARNED)
    assert (t.name, t.attention) == ("ort-cpu", "gqa") and t.why.startswith("auto:")
    assert resolve_target("auto", None, True, "fp32", False, DecoderConfig(pos_embedding="rope")).name == "ort-cpu"


@pytest.mark.parametrize("fuse, dtype, cfg, why", [
    (False, "fp32", LEARNED, "no --fuse"),
    (True, "fp16", LEARNED, "--dtype fp16"),
    (True, "bf16", LEARNED, "--dtype bf16"),
    (True, "fp32", TINY_ROPE, "head size 8 with rope"),
    (True, "fp32", PARTIAL_ROPE, "partial rotary (16 of 32 dims"),
])
def test_auto_falls_back_to_portable_and_says_why(no_tensorrt, fuse, dtype, cfg, why):
    t = resolve_target("auto", None, fuse, dtype, False, cfg)
    assert (t.name, t.attention) == ("portable", "plain") and why in t.why


def test_auto_is_portable_where_tensorrt_is_installed(monkeypatch):
    monkeypatch.setattr(target_module.importlib.util, "find_spec", lambda name, *a: object())
    t = resolve_target("auto", None, True, "fp32", False, LEARNED)
    assert (t.name, t.attention) == ("portable", "plain") and "TensorRT is installed" in t.why


def test_explicit_options_decide():
    assert resolve_target("portable", None, True, "fp32", False, None) == Target("portable", "plain")
    assert resolve_target("ort-cpu", None, True, "fp32", False, LEARNED) == Target("ort-cpu", "gqa")
    assert resolve_target("auto", "fused", True, "fp32", False, None) == Target("portable", "fused")
    assert resolve_target("auto", "gqa", True, "fp32", False, None) == Target("ort-cpu", "gqa")
    assert resolve_target("auto", None, True, "fp32", True, None) == Target("ort-cpu", "gqa")     # --genai


@pytest.mark.parametrize("args, message", [
    (("portable", "gqa", True, "fp32", False, None), "--target portable: expected --target ort-cpu or none with "
                                                     "--attention gqa"),
    (("ort-cpu", "plain", True, "fp32", False, None), "--target ort-cpu: expected --target portable or none"),
    (("portable", None, True, "fp32", True, None), "--target portable: expected ort-cpu or none with --genai"),
    (("ort-cpu", None, True, "fp32", False, TINY_ROPE), "found head size 8 with rope"),
    (("ort-cpu", None, True, "fp16", False, LEARNED), "found --dtype fp16"),
    (("auto", None, True, "fp32", True, TINY_ROPE), "--genai: expected a model ONNX Runtime's GroupQueryAttention "
                                                    "takes, found head size 8 with rope"),
])
def test_contradictions_are_refused(args, message):
    with pytest.raises(UsageError) as e:
        resolve_target(*args)
    assert message in str(e.value) and "; " in str(e.value)      # what was found; the fix


def test_the_line_says_which_graph_runs_where():
    line = Target("ort-cpu", "gqa", "auto: the fastest graph on this CPU").describe(["model.fused.onnx",
                                                                                     "model.int4.onnx"])
    assert line == ("target   ort-cpu (auto: the fastest graph on this CPU): model.fused.onnx, model.int4.onnx for "
                    "ONNX Runtime on the CPU (GroupQueryAttention: ONNX Runtime only); ONNX Runtime given the "
                    "folder runs model.int4.onnx; for TensorRT and other runtimes: --target portable")
    assert "given the folder" not in Target("portable", "plain").describe(["model.fused.onnx"])


def test_cli_refuses_a_contradiction_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--target", "portable", "--attention", "gqa",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --target portable: expected --target ort-cpu or none with --attention gqa, which builds the ort-cpu "
        "graph; drop one of the two"]
    assert not (tmp_path / "out").exists()
