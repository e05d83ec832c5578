"""TensorRT session on a GPU: engine built once then reused, in-place cache, same tokens as ORT.

Skipped with a reason where tensorrt is not importable or no CUDA device exists.
Not yet run on a GPU (docs/runtime.md, GPU status).
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ATOL_FP32 = 1e-3   # TensorRT picks other kernels and summation orders than ORT's CPU provider; logits are O(1)
ATOL_TF32 = 5e-2   # TF32 rounds matmul inputs to 10-bit mantissas (~1e-3 relative) over d=32 products and 2 layers


@pytest.fixture(scope="module")
def trt_ready():
    pytest.importorskip("tensorrt", reason="tensorrt is not installed: pip install 'tapernorm-deploy[tensorrt]'")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")


@pytest.fixture(scope="module")
def trt_build(trt_ready, tmp_path_factory, request):
    import shutil
    _, build = request.getfixturevalue("tiny")          # only now: a skip above exports nothing
    out = tmp_path_factory.mktemp("trt_build")          # engines land next to the model: keep the shared build clean
    for f in build.iterdir():
        shutil.copyfile(f, out / f.name)
    return out


def test_engine_is_built_once_then_reused(trt_build):
    from runtime.trt_session import TrtSession
    from runtime.trt_engine import BuildOptions
    opts = BuildOptions(max_batch=4, opt_batch=1)
    with TrtSession(trt_build, options=opts) as first:
        assert first.loader.built and first.loader.path.is_file()
        path = first.loader.path
    assert any(p.name.startswith("timing.") for p in trt_build.iterdir())
    with TrtSession(trt_build, options=opts) as second:
        assert not second.loader.built and second.loader.path == path


@pytest.mark.parametrize("tf32", [False, True], ids=["tf32-off", "tf32-on"])
def test_trt_matches_ort_and_updates_in_place(trt_build, tf32, record_property):
    """Prefill + decode steps against ORT CPU; the engine aliases every present_* to its cache
    (checked on activate), has one KV-cache update layer per cache, and never moves a cache."""
    from runtime.ort_session import OrtSession
    from runtime.trt_engine import BuildOptions
    from runtime.trt_session import TrtSession
    atol = ATOL_TF32 if tf32 else ATOL_FP32
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    diffs = []
    with TrtSession(trt_build, options=BuildOptions(max_batch=4, tf32=tf32)) as t, OrtSession(trt_build) as o:
        report = t.loader.report()
        assert report["tf32"] is tf32
        assert report["kv_cache_layers"] == len(t.spec.cache_names())     # counted at build, kept in its record
        assert all(t.engine.get_aliased_input_tensor(f"present_{n}") == n for n in t.spec.cache_names())
        t.reset(2), o.reset(2)
        a, b = t.prefill(ids), o.prefill(ids)
        diffs.append(float(np.abs(a - b).max()))
        np.testing.assert_allclose(a, b, atol=atol)
        ptrs = t.cache_ptrs()
        for p in range(3, 10):
            tok = np.array([p, 3 * p])
            a, b = t.decode_step(tok, np.array([p, p])), o.decode_step(tok, np.array([p, p]))
            diffs.append(float(np.abs(a - b).max()))
            np.testing.assert_allclose(a, b, atol=atol)
        assert t.cache_ptrs() == ptrs
        key0 = t.caches["key_0"].cpu().numpy()
        np.testing.assert_allclose(key0[:, :, :10], o.cache_array("key_0")[:, :, :10], atol=atol)
    record_property("max_abs_diff_vs_ort_cpu", max(diffs))          # lands in the junit XML gpu_check keeps
    record_property("engine", report)


def test_trt_generate_ragged_batch_equals_ort(trt_build):
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    from runtime.trt_engine import BuildOptions
    from runtime.trt_session import TrtSession
    from tests.runtime.greedy import compare_greedy
    prompts = [[5, 17, 42], [7, 99, 3, 250, 11, 64, 8], [200], [31, 41, 59, 26, 53]]
    cfg = GenerationConfig(max_new_tokens=16, keep_logits=True)
    with TrtSession(trt_build, options=BuildOptions(max_batch=4)) as t, OrtSession(trt_build) as o:
        rt, ro = generate(t, prompts, cfg), generate(o, prompts, cfg)
    for b in range(4):
        compare_greedy(ro.tokens[b], [l[b] for l in ro.logits], rt.tokens[b], [l[b] for l in rt.logits])


@pytest.fixture(scope="module")
def trt_live_build(trt_ready, tmp_path_factory):
    """A portable build at 1024 slots: its attention is export/emit.py's If per layer over the live slots."""
    import subprocess
    import sys
    from export.emit import LIVE_CUT_FROM
    from tests.helpers import random_model, write_checkpoint
    root = tmp_path_factory.mktemp("trt_live")
    ckpt = write_checkpoint(root / "ckpt", random_model(seed=4, n_layer=2, max_seq_len=LIVE_CUT_FROM))
    proc = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--target", "portable", "--checkpoint",
                           str(ckpt), "--out", str(root / "build")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "build"


def test_trt_runs_the_live_slot_cut_as_ort_does(trt_live_build, record_property):
    """The If per layer (the caches cut to the live slots while 3 L <= S_max, else the whole cache) parses,
    keeps one KV-cache update layer per cache, and gives ORT CPU's logits on both sides of the condition."""
    from export.emit import CUT_BELOW, LIVE_CUT_FROM
    from runtime.ort_session import OrtSession
    from runtime.trt_engine import BuildOptions
    from runtime.trt_session import TrtSession
    diffs = []
    with TrtSession(trt_live_build, options=BuildOptions(max_batch=2, tf32=False)) as t, OrtSession(trt_live_build) as o:
        assert t.loader.report()["kv_cache_layers"] == len(t.spec.cache_names())
        t.reset(1), o.reset(1)
        ids = np.arange(1, 201)[None] % 300
        a, b = t.prefill(ids), o.prefill(ids)                      # L = 200: the cut branch
        diffs.append(float(np.abs(a - b).max()))
        for p in range(200, LIVE_CUT_FROM // CUT_BELOW + 40, 7):    # past a third: the whole cache
            tok = np.array([p % 300])
            a, b = t.decode_step(tok, np.array([p])), o.decode_step(tok, np.array([p]))
            diffs.append(float(np.abs(a - b).max()))
    record_property("max_abs_diff_vs_ort_cpu", max(diffs))
    assert max(diffs) <= ATOL_FP32, diffs
