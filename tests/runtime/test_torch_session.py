"""PyTorch session: equal to the decoder's own forward; torch.compile; CUDA graphs on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import load_checkpoint
from runtime.torch_session import TorchSession


def test_matches_the_uncached_forward(tiny):
    ckpt, _ = tiny
    model = load_checkpoint(ckpt)
    ids = np.array([[3, 9, 27, 81, 243, 4, 12]])
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).numpy()                # [1, T, V], no cache
    with TorchSession(ckpt) as s:
        s.reset(1)
        np.testing.assert_allclose(s.prefill(ids[:, :4]), ref[:, :4], atol=1e-5)
        for t in range(4, 7):
            np.testing.assert_allclose(s.decode_step(ids[:, t], np.array([t])), ref[:, t], atol=1e-5)


def test_reset_reuses_buffers_for_the_same_batch(tiny):
    ckpt, _ = tiny
    with TorchSession(ckpt) as s:
        s.reset(2)
        ptr = s.cache[0][0].data_ptr()
        s.reset(2)
        assert s.cache[0][0].data_ptr() == ptr
        s.reset(3)
        assert s.cache[0][0].shape[0] == 3


def test_decode_steps_write_the_same_cache_tensors(tiny):
    ckpt, _ = tiny
    with TorchSession(ckpt) as s:
        s.reset(2)
        s.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
        ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in s.cache]
        before = s.cache[1][1].clone()
        s.decode_step(np.array([7, 8]), np.array([3, 3]))
        assert [(k.data_ptr(), v.data_ptr()) for k, v in s.cache] == ptrs
        changed = (s.cache[1][1] != before).any(dim=-1).any(dim=1).any(dim=0).nonzero().flatten().tolist()
        assert changed == [3]


@pytest.mark.slow
def test_torch_compile_matches_eager(tiny):
    ckpt, _ = tiny
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    with TorchSession(ckpt) as e, TorchSession(ckpt, compile=True) as c:
        e.reset(2), c.reset(2)
        np.testing.assert_allclose(c.prefill(ids), e.prefill(ids), atol=1e-5)
        for p in range(3, 6):
            tok = np.array([p, p + 1])
            np.testing.assert_allclose(c.decode_step(tok, np.array([p, p])), e.decode_step(tok, np.array([p, p])), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_graph_decode_matches_cpu(tiny_checkpoint):
    ckpt = tiny_checkpoint
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    with TorchSession(ckpt, device="cuda") as g, TorchSession(ckpt) as c:
        g.reset(2), c.reset(2)
        assert g._graph is not None
        np.testing.assert_allclose(g.prefill(ids), c.prefill(ids), atol=1e-3)
        for p in range(3, 10):
            tok = np.array([p, 2 * p])
            np.testing.assert_allclose(g.decode_step(tok, np.array([p, p])), c.decode_step(tok, np.array([p, p])), atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_graph_bf16_decode_is_close_to_fp32(tiny_checkpoint):
    """bf16 keeps 8 mantissa bits: logits of O(1) agree with fp32 to ~1e-2; ATOL_BF16 leaves room for 2 layers."""
    ATOL_BF16 = 0.1
    ids = np.array([[1, 2, 3]])
    with TorchSession(tiny_checkpoint, device="cuda", dtype="bf16") as h, TorchSession(tiny_checkpoint) as c:
        h.reset(1), c.reset(1)
        assert h._graph is not None
        np.testing.assert_allclose(h.prefill(ids), c.prefill(ids), atol=ATOL_BF16)
        for p in range(3, 8):
            tok = np.array([p])
            np.testing.assert_allclose(h.decode_step(tok, np.array([p])), c.decode_step(tok, np.array([p])), atol=ATOL_BF16)
