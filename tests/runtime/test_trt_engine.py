"""TensorRT engine building blocks that need no GPU: profiles, cache keys, file names, I/O mapping,
the builder flags and checks (against a recording stand-in for the tensorrt module, tests/runtime/fake_trt.py)."""
from __future__ import annotations

import sys

import pytest

import runtime.trt_engine as trt_engine
from core.contract import DecodeContract
from runtime.session import ModelFileError
from runtime.trt_engine import (DECODE_PROFILE, PREFILL_PROFILE, BuildOptions, EngineBuildError, EngineFromOnnx,
                                check_aliases, check_engine_io, device_tag, engine_cache_key, engine_path, file_digest,
                                io_mapping, profile_shapes, timing_cache_path)
from tests.runtime.fake_trt import FakeEngine, fake_tensorrt

SPEC = DecodeContract(n_layer=2, n_kv_head=4, head_dim=8, capacity=64, vocab_size=320)


def test_profiles_cover_decode_and_prefill():
    profiles = profile_shapes(SPEC, BuildOptions(max_batch=8, opt_batch=4, opt_prompt=16))
    decode, prefill = profiles[DECODE_PROFILE], profiles[PREFILL_PROFILE]
    assert decode["input_ids"] == ((1, 1), (4, 1), (8, 1))
    assert prefill["input_ids"] == ((1, 1), (4, 16), (8, 64))          # max_prompt defaults to the capacity
    for p in profiles:
        assert p["position"] == ((1,), (4,), (8,))
        assert set(p) == {"input_ids", "position", "key_0", "value_0", "key_1", "value_1"}
        assert p["key_1"] == ((1, 4, 64, 8), (4, 4, 64, 8), (8, 4, 64, 8))  # S_max static: in-place cache update


@pytest.mark.parametrize("bad", [BuildOptions(max_batch=0), BuildOptions(max_batch=2, opt_batch=4),
                                 BuildOptions(max_prompt=65), BuildOptions(max_prompt=8, opt_prompt=9)])
def test_bad_build_options(bad):
    with pytest.raises(ValueError, match="BuildOptions"):
        profile_shapes(SPEC, bad)


def test_io_mapping_aliases_each_present_cache_to_its_input():
    io = io_mapping(SPEC)
    assert io.inputs == ("input_ids", "position", "key_0", "value_0", "key_1", "value_1")
    assert io.outputs == ("logits", "present_key_0", "present_value_0", "present_key_1", "present_value_1")
    assert io.aliases == {"present_key_0": "key_0", "present_value_0": "value_0",
                          "present_key_1": "key_1", "present_value_1": "value_1"}


def test_check_engine_io():
    io = io_mapping(SPEC)
    names = {**{n: "input" for n in io.inputs}, **{n: "output" for n in io.outputs}}
    check_engine_io(names, SPEC, "e.engine")
    with pytest.raises(ModelFileError, match="missing .'present_key_1'."):
        check_engine_io({k: v for k, v in names.items() if k != "present_key_1"}, SPEC, "e.engine")
    with pytest.raises(ModelFileError, match="wrong direction .'position'."):
        check_engine_io({**names, "position": "output"}, SPEC, "e.engine")


def test_cache_key_depends_on_everything_the_engine_does():
    base = dict(onnx_digest="a" * 64, trt_version="11.0.0", device="nvidia-h200-sm90", spec=SPEC, options=BuildOptions())
    key = engine_cache_key(**base)
    assert len(key) == 16 and key == engine_cache_key(**base)
    # an equivalent spelling of the defaults is the same engine
    assert key == engine_cache_key(**{**base, "options": BuildOptions(max_prompt=64, opt_prompt=64)})
    for change in ({"onnx_digest": "b" * 64}, {"trt_version": "11.1.0"}, {"device": "nvidia-a100-sm80"},
                   {"options": BuildOptions(max_batch=16)}, {"options": BuildOptions(opt_prompt=32)},
                   {"spec": DecodeContract(2, 4, 8, 128, 320)}, {"spec": DecodeContract(2, 4, 8, 64, 320, "fp16")},
                   {"options": BuildOptions(tf32=True)}, {"options": BuildOptions(version_compatible=True)}):
        assert engine_cache_key(**{**base, **change}) != key, change


def test_file_names_next_to_the_model(tmp_path):
    onnx_path = tmp_path / "model.fused.onnx"
    onnx_path.write_bytes(b"graph")
    assert engine_path(onnx_path, "0123456789abcdef") == tmp_path / "model.fused.0123456789abcdef.engine"
    assert timing_cache_path(onnx_path, "nvidia-h200-sm90") == tmp_path / "timing.nvidia-h200-sm90.cache"
    assert device_tag("NVIDIA H200", (9, 0)) == "nvidia-h200-sm90"
    d1 = file_digest(onnx_path)
    (tmp_path / "model.fused.onnx.data").write_bytes(b"weights")
    assert file_digest(onnx_path) != d1                               # external data counts too


def test_tf32_is_off_by_default():
    assert BuildOptions().tf32 is False and BuildOptions().resolved(SPEC).tf32 is False
    assert BuildOptions(tf32=True).resolved(SPEC).tf32 is True          # resolved() keeps every field


@pytest.fixture
def with_fake_trt(monkeypatch, tmp_path):
    """Install a fake tensorrt (4 KV-cache update layers: SPEC's 2 layers x key, value) and a fake GPU."""
    def install(**kw):
        trt = fake_tensorrt(**{"kv_cache_layers": 4, **kw})
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setattr(trt_engine, "cuda_device_tag", lambda: "nvidia-h200-sm90")
        return trt
    onnx_path = tmp_path / "model.fused.onnx"
    onnx_path.write_bytes(b"graph")
    return install, onnx_path


def test_build_clears_tf32_unless_asked_and_keys_the_engine_by_it(with_fake_trt):
    install, onnx_path = with_fake_trt
    trt = install()
    parity = EngineFromOnnx(onnx_path, SPEC, BuildOptions(max_batch=4))
    assert parity() == b"engine tf32=0" and parity.built
    config = trt.configs[-1]
    assert "TF32" not in config.flags and "VERSION_COMPATIBLE" not in config.flags
    assert len(config.profiles) == 2 and config.profiles[DECODE_PROFILE]["input_ids"] == ((1, 1), (1, 1), (4, 1))
    fast = EngineFromOnnx(onnx_path, SPEC, BuildOptions(max_batch=4, tf32=True, version_compatible=True))
    assert fast() == b"engine tf32=1" and {"TF32", "VERSION_COMPATIBLE"} <= trt.configs[-1].flags
    assert fast.path != parity.path                                      # TF32 is part of the cache key
    report = parity.report()
    assert report["tf32"] is False and report["kv_cache_layers"] == 4 and report["tensorrt"] == trt.__version__
    info = trt_engine.read_engine_info(parity.path)                     # the build record beside the engine
    assert info["tensorrt"] == trt.__version__ and info["tf32"] is False and info["options"]["max_batch"] == 4
    assert info["device"] == "nvidia-h200-sm90" and trt_engine.read_engine_info(onnx_path) is None
    again = EngineFromOnnx(onnx_path, SPEC, BuildOptions(max_batch=4))
    assert again() == b"engine tf32=0" and not again.built and again.path == parity.path
    assert again.report()["kv_cache_layers"] == 4                          # read back from the build record
    assert len(trt.configs) == 2                                          # reused, not rebuilt
    assert timing_cache_path(onnx_path, "nvidia-h200-sm90").read_bytes() == b"timing"


def test_build_refuses_a_graph_without_one_kv_cache_update_layer_per_cache(with_fake_trt):
    install, onnx_path = with_fake_trt
    install(kv_cache_layers=0)              # e.g. the parser lowered the cache write to ScatterND copies
    loader = EngineFromOnnx(onnx_path, SPEC)
    with pytest.raises(EngineBuildError, match="expected 4 KV-cache update layers .*found 0"):
        loader()
    assert not list(onnx_path.parent.glob("*.engine"))                  # nothing half-written


def test_parse_errors_are_one_line(with_fake_trt):
    install, onnx_path = with_fake_trt
    install(parse_errors=("node 12 (Unique): unsupported", "node 13: bad"))
    with pytest.raises(EngineBuildError) as e:
        EngineFromOnnx(onnx_path, SPEC)()
    assert "\n" not in str(e.value) and "Unique" in str(e.value) and "TensorRT lint" in str(e.value)


def test_check_aliases():
    good = {f"present_{n}": n for n in SPEC.cache_names()}
    check_aliases(FakeEngine(good), SPEC, "e.engine")
    with pytest.raises(ModelFileError, match="found 1 that do not .present_value_1 -> None."):
        check_aliases(FakeEngine({**good, "present_value_1": None}), SPEC, "e.engine")
    with pytest.raises(ModelFileError, match="present_key_0 -> key_1"):
        check_aliases(FakeEngine({**good, "present_key_0": "key_1"}), SPEC, "e.engine")
    with pytest.raises(ModelFileError, match=">= 10.15"):
        check_aliases(object(), SPEC, "e.engine")


def test_a_gqa_graph_is_refused_before_any_tensorrt_work(tmp_path):
    """A GroupQueryAttention graph (export.build's default target here) runs in ONNX Runtime only: one line up
    front from the graph's own mark, no CUDA needed; a GenAI graph is not our contract."""
    import onnx
    from onnx import helper
    from runtime.session import ModelFileError
    from runtime.trt_session import TrtSession
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = helper.make_model(graph)
    onnx.helper.set_model_props(model, {"tapernorm.attention": "ort-gqa"})
    onnx.save(model, tmp_path / "model.fused.onnx")
    with pytest.raises(ModelFileError, match="found ONNX Runtime's GroupQueryAttention .*; use --backend ort, or "
                                             "rebuild with --target portable"):
        TrtSession(tmp_path)
    onnx.helper.set_model_props(model, {"tapernorm.attention": "portable"})
    onnx.save(model, tmp_path / "model.fused.onnx")
    assert TrtSession(tmp_path).path.name == "model.fused.onnx"        # other graphs pass this check
    onnx.save(model, tmp_path / "model.genai.onnx")
    with pytest.raises(ModelFileError, match="found ONNX Runtime GenAI's .*og.Model"):
        TrtSession(tmp_path / "model.genai.onnx")
