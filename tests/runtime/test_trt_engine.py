"""TensorRT engine building blocks that need no GPU: profiles, cache keys, file names, I/O mapping."""
from __future__ import annotations

import pytest

from runtime.session import ModelFileError, ModelSpec
from runtime.trt_engine import (DECODE_PROFILE, PREFILL_PROFILE, BuildOptions, check_engine_io, device_tag,
                                engine_cache_key, engine_path, file_digest, io_mapping, profile_shapes,
                                timing_cache_path)

SPEC = ModelSpec(n_layer=2, n_kv_head=4, head_dim=8, capacity=64, vocab_size=320)


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
                   {"spec": ModelSpec(2, 4, 8, 128, 320)}, {"spec": ModelSpec(2, 4, 8, 64, 320, "fp16")}):
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
