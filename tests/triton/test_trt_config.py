"""decoder_trt's config (issue 15): both optimization profiles in instance_group, the engine's build
record (TensorRT version, max_batch) carried into repository.json and checked against --max-batch-size."""
from __future__ import annotations

import json

import pytest


def _config(repo, model):
    from runtime.triton.repository import parse_config
    return parse_config((repo / model / "config.pbtxt").read_text())


def test_tensorrt_instances_may_use_the_prefill_profile(triton_repo):
    from runtime.trt_engine import DECODE_PROFILE, PREFILL_PROFILE
    (trt_group,) = _config(triton_repo, "decoder_trt").instance_group
    assert list(trt_group.profile) == [str(DECODE_PROFILE), str(PREFILL_PROFILE)]   # Triton's default: profile 0 only
    (ort_group,) = _config(triton_repo, "decoder_onnx").instance_group
    assert list(ort_group.profile) == []                                            # profiles are TensorRT-only
    for state in _config(triton_repo, "decoder_trt").sequence_batching.state:
        assert state.use_same_buffer_for_input_output


def _engine_with_record(tmp_path, max_batch: int):
    from runtime.trt_engine import engine_info_path
    engine = tmp_path / "model.fused.0123abcd.engine"
    engine.write_bytes(b"ftrt stand-in engine")
    engine_info_path(engine).write_text(json.dumps({"tensorrt": "11.4.0.106", "tf32": False, "version_compatible": False,
                                                    "device": "nvidia-h200-sm90", "options": {"max_batch": max_batch}}))
    return engine


def test_engine_build_record_lands_in_repository_json(triton_build, tmp_path):
    from runtime.triton import write_triton_repository
    repo = write_triton_repository(triton_build, tmp_path / "repo", engine=_engine_with_record(tmp_path, 8),
                                   max_batch_size=8)
    record = json.loads((repo / "repository.json").read_text())["engine_build"]
    assert record["tensorrt"] == "11.4.0.106" and record["device"] == "nvidia-h200-sm90"


def test_max_batch_size_above_the_engines_is_refused(triton_build, tmp_path):
    from runtime.triton import write_triton_repository
    from runtime.triton.repository import RepositoryError
    with pytest.raises(RepositoryError, match="found one built for 4; pass --max-batch-size 4"):
        write_triton_repository(triton_build, tmp_path / "repo", engine=_engine_with_record(tmp_path, 4),
                                max_batch_size=8)
    assert not (tmp_path / "repo").exists()
