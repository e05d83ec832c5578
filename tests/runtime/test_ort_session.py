"""ONNX Runtime session: values equal to torch, the cache updated in place (no copy, no growing allocation)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from runtime.ort_session import OrtSession
from runtime.torch_session import TorchSession
from tests.runtime.conftest import REPO

ATOL_FP32 = 1e-4   # ORT fuses/reorders fp32 ops; tiny-model logits are O(1)


def test_prefill_and_decode_match_torch(tiny):
    ckpt, build = tiny
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, (2, 5))
    with OrtSession(build) as o, TorchSession(ckpt) as t:
        for s in (o, t):
            s.reset(2)
        np.testing.assert_allclose(o.prefill(ids), t.prefill(ids), atol=ATOL_FP32)
        pos = np.array([5, 5])
        for step in range(4):
            tok = rng.integers(0, 300, 2)
            np.testing.assert_allclose(o.decode_step(tok, pos + step), t.decode_step(tok, pos + step), atol=ATOL_FP32)


def test_prefill_equals_token_by_token(tiny):
    """One prefill of T tokens and T single-token steps leave the same logits and cache."""
    _, build = tiny
    ids = np.array([[5, 17, 42, 7, 99, 3]])
    with OrtSession(build) as a, OrtSession(build) as b:
        a.reset(1), b.reset(1)
        full = a.prefill(ids).copy()
        steps = np.stack([b.decode_step(ids[:, t], np.array([t])).copy() for t in range(ids.shape[1])], axis=1)
        np.testing.assert_allclose(full, steps, atol=ATOL_FP32)
        np.testing.assert_allclose(a.cache_array("key_1"), b.cache_array("key_1"), atol=ATOL_FP32)


def test_decode_step_writes_the_bound_cache_in_place(tiny):
    _, build = tiny
    with OrtSession(build) as s:
        s.reset(2)
        s.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
        ptrs = s.cache_ptrs()
        view = s.cache_array("key_0")               # numpy view of the bound OrtValue's memory
        assert view.ctypes.data == ptrs["key_0"]
        for p in range(3, 10):
            before = view.copy()
            s.decode_step(np.array([7, 8]), np.array([p, p]))
            assert s.cache_ptrs() == ptrs, "a cache OrtValue moved: the step copied it"
            changed = np.flatnonzero(np.abs(view - before).sum(axis=(0, 1, 3)))
            assert changed.tolist() == [p], f"step at position {p} changed slots {changed.tolist()} of the bound buffer"


def test_decode_step_allocates_nothing_that_grows(tiny):
    """Python-side allocations per step stay flat across positions (tracemalloc)."""
    _, build = tiny
    with OrtSession(build) as s:
        s.reset(2)
        s.prefill(np.array([[1, 2], [3, 4]]))
        tok = np.array([5, 6])
        positions = [np.array([p, p]) for p in range(2, 40)]
        for p in positions[:3]:
            s.decode_step(tok, p)               # warm-up
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        current = np.zeros(len(positions) - 3, np.int64)   # preallocated: the probe itself must not allocate
        for i, p in enumerate(positions[3:]):
            s.decode_step(tok, p)
            current[i] = tracemalloc.get_traced_memory()[0]
        current -= base
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert max(current) < 4096 and peak - base < 16384, f"per-step Python memory grows: {current.tolist()}, peak {peak - base}"
    assert current[-1] <= current[0] + 512, f"retained memory grows with position: {current.tolist()}"


INPLACE_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, onnxruntime as ort
    from runtime.ort_session import OrtSession
    s = OrtSession(sys.argv[1], log_severity=2).activate()   # warnings on: ORT prints the copy warning at this level
    s.reset(2)
    s.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
    for p in range(3, 6):
        s.decode_step(np.array([7, 8]), np.array([p, p]))
    if sys.argv[2] == "copying":   # control: a fresh output for present_key_0 must make ORT warn
        s.binding.bind_output("present_key_0", "cpu")
        s.decode_step(np.array([7, 8]), np.array([6, 6]))
    print("done")
""")


@pytest.mark.parametrize("mode", ["in_place", "copying"])
def test_ort_reports_no_cache_copy(tiny, mode):
    """ORT logs 'in-place optimization not activated, copying' when TensorScatter copies; our binding never does."""
    _, build = tiny
    proc = subprocess.run([sys.executable, "-c", INPLACE_SCRIPT, str(build / "model.onnx"), mode],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    copying = "in-place optimization not activated" in proc.stderr
    assert copying == (mode == "copying"), proc.stderr[-2000:]


def test_batch_mismatch_and_capacity_are_checked(tiny):
    from runtime.session import CapacityError
    _, build = tiny
    with OrtSession(build) as s:
        s.reset(2)
        with pytest.raises(ValueError, match="reset"):
            s.decode_step(np.array([1]), np.array([0]))
        with pytest.raises(CapacityError, match="capacity"):
            s.decode_step(np.array([1, 2]), np.array([0, s.spec.capacity]))


def test_spec_from_the_graph(tiny):
    ckpt, build = tiny
    from models.checkpoint import load_checkpoint
    from core.contract import DecodeContract
    with OrtSession(build) as s:
        assert s.spec == DecodeContract.from_config(load_checkpoint(ckpt).cfg)


def _has_ort_cuda() -> bool:
    import onnxruntime as ort
    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_ort_cuda(),   # decided before the `tiny` fixture exports anything
                    reason="onnxruntime-gpu (CUDAExecutionProvider) is not installed: pip install 'tapernorm-deploy[gpu]'")
def test_ort_cuda_provider_matches_cpu(tiny):
    _, build = tiny
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    with OrtSession(build, device="cuda") as g, OrtSession(build) as c:
        g.reset(2), c.reset(2)
        np.testing.assert_allclose(g.prefill(ids), c.prefill(ids), atol=1e-3)
        ptrs = g.cache_ptrs()
        for p in range(3, 8):
            np.testing.assert_allclose(g.decode_step(np.array([7, 8]), np.array([p, p])),
                                       c.decode_step(np.array([7, 8]), np.array([p, p])), atol=1e-3)
        assert g.cache_ptrs() == ptrs


def test_step_timing_splits_each_step(tiny):
    from runtime.step_timing import summarize, time_decode_steps
    _, build = tiny
    with OrtSession(build) as s:
        t = time_decode_steps(s, batch=2, prompt_len=4, steps=5, warmup=2)
    assert set(t) == {"step", "run", "outside"} and len(t["step"]) == 5
    assert (t["run"] > 0).all() and (t["outside"] >= 0).all() and (t["run"] <= t["step"]).all()
    assert "outside p50" in summarize(t)


@pytest.mark.slow
def test_fp16_graph_runs_with_fp16_caches_and_logits(tmp_path):
    from tests.export.oracle import export_onnx
    from tests.helpers import random_model
    model = random_model(seed=2, n_layer=2, max_seq_len=48)
    export_onnx(model, tmp_path / "model.onnx", dtype="fp16")
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    with OrtSession(tmp_path) as o, TorchSession(model) as t:
        assert o.spec.dtype == "fp16"
        o.reset(2), t.reset(2)
        logits = o.prefill(ids)
        assert logits.dtype == np.float16 and o.cache_array("key_0").dtype == np.float16
        np.testing.assert_allclose(logits.astype(np.float32), t.prefill(ids), atol=2e-3)   # fp16 rounding of O(1) logits


def test_ort_profiling_option(tiny, tmp_path):
    import json
    from pathlib import Path
    _, build = tiny
    with OrtSession(build, profile_prefix=tmp_path / "ort") as s:
        s.reset(1)
        s.prefill(np.array([[1, 2]]))
        s.decode_step(np.array([3]), np.array([2]))
        trace = Path(s.session.end_profiling())
    assert trace.parent == tmp_path and any(e.get("name") == "model_run" for e in json.loads(trace.read_text()))


def test_profile_events_end_profiling_and_read_its_trace(tiny, tmp_path):
    """bench's norm shares read a session's profile through this one method."""
    _, build = tiny
    with OrtSession(build, profile_prefix=tmp_path / "ort") as s:
        s.reset(1)
        s.prefill(np.array([[1, 2]]))
        events = s.profile_events()
    assert any(e.get("name") == "model_run" for e in events)
    with OrtSession(build) as s, pytest.raises(ValueError, match="profiling is off"):
        s.profile_events()


def test_check_provider_wants_the_asked_provider_first():
    from runtime.ort_session import check_provider
    from runtime.session import DeviceError
    check_provider(["CUDAExecutionProvider", "CPUExecutionProvider"], "cuda", "m.onnx")
    check_provider(["CPUExecutionProvider"], "cpu", "m.onnx")
    for providers, device in ((["CPUExecutionProvider"], "cuda"), ([], "cuda"),
                              (["CUDAExecutionProvider", "CPUExecutionProvider"], "tensorrt")):
        with pytest.raises(DeviceError) as e:
            check_provider(providers, device, "m.onnx")
        assert "\n" not in str(e.value) and f"--device {device}" in str(e.value)


def test_cuda_that_silently_falls_back_to_cpu_is_one_clear_error(tiny, monkeypatch):
    """onnxruntime-gpu lists CUDAExecutionProvider even when its CUDA libraries cannot load; the
    session then runs on the CPU and says so only in its log. Here the CPU build is made to list
    CUDA as available: InferenceSession really falls back, as it does on a broken GPU install."""
    import onnxruntime as ort
    from runtime.session import DeviceError
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here: the fallback cannot be staged")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    _, build = tiny
    session = OrtSession(build, device="cuda", log_severity=3)
    with pytest.raises(DeviceError, match="expected the session to run on CUDAExecutionProvider, found CPUExecutionProvider"):
        session.activate()
    assert not session.is_active and session.session is None


@pytest.mark.parametrize("graph", ["gqa", "plain"])
def test_a_prefill_asked_for_its_last_logits_equals_the_full_ones_tail(tiny, tiny_gqa, graph):
    """export.build's ONNX Runtime CPU graph takes logits_from and computes the LM head of the positions
    [logits_from, T) only; a graph without the input (tiny's plain export) returns a view of its full logits.
    Either way: the full prefill's tail, and the decode steps after it (whole batch and rows) are those after a
    full prefill (the binding's logits_from goes back to 0 for them)."""
    build, takes = (tiny_gqa[1], True) if graph == "gqa" else (tiny[1], False)
    rng = np.random.default_rng(3)
    ids, tok = rng.integers(0, 300, (3, 9)), rng.integers(0, 300, 3)
    with OrtSession(build) as full, OrtSession(build) as cut:
        assert cut.spec.takes_logits_from == takes
        for s in (full, cut):
            s.reset(3)
        want = full.prefill(ids).copy()
        got = cut.prefill(ids, None, 6).copy()
        assert got.shape == (3, 3, cut.spec.vocab_size)
        np.testing.assert_allclose(got, want[:, 6:], rtol=0, atol=1e-6)     # the same arithmetic per row
        np.testing.assert_allclose(cut.decode_step(tok, np.full(3, 9)), full.decode_step(tok, np.full(3, 9)),
                                   rtol=0, atol=1e-6)
        want = full.prefill_rows(1, ids[1:, :5]).copy()
        got = cut.prefill_rows(1, ids[1:, :5], None, 4).copy()
        assert got.shape == (2, 1, cut.spec.vocab_size)
        np.testing.assert_allclose(got, want[:, 4:], rtol=0, atol=1e-6)
        np.testing.assert_allclose(cut.decode_rows(1, tok[1:], np.full(2, 5)), full.decode_rows(1, tok[1:], np.full(2, 5)),
                                   rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="logits_from 5 for a 5-token step; expected 0 <= logits_from < 5"):
            cut.prefill_rows(1, ids[1:, :5], None, 5)
