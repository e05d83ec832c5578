import math

import pytest
import torch

from train.scale_loss import scale_loss, token_rms


def _tokens_at_scale(s: float, shape=(3, 5, 16), seed=0) -> torch.Tensor:
    h = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return h * (s / h.pow(2).mean(-1, keepdim=True).sqrt())  # every token's rms is exactly s


@pytest.mark.parametrize("s_tgt", [1.0, 0.37, 4.5])
def test_zero_loss_and_zero_gradient_at_the_target_scale(s_tgt):
    h = _tokens_at_scale(s_tgt).requires_grad_(True)
    loss = scale_loss(h, s_tgt, lam=0.3)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    assert h.grad.abs().max() < 1e-6


def test_value_is_lambda_times_mean_squared_log_ratio():
    h = torch.cat([_tokens_at_scale(2.0, (1, 1, 8)), _tokens_at_scale(0.5, (1, 1, 8), seed=1)], dim=1)
    loss = scale_loss(h, 1.0, lam=0.1)
    assert float(loss) == pytest.approx(0.1 * math.log(2.0) ** 2, rel=1e-5)
    assert token_rms(h).flatten().tolist() == pytest.approx([2.0, 0.5])


def test_gradient_off_target_is_radial_and_restoring():
    h = _tokens_at_scale(3.0, (1, 4, 16)).requires_grad_(True)
    scale_loss(h, 1.0, lam=1.0).backward()
    g = h.grad[0]
    cos = torch.nn.functional.cosine_similarity(g, h.detach()[0], dim=-1)
    assert torch.allclose(cos, torch.ones(4, dtype=cos.dtype), atol=1e-6)  # along h: a gradient step shrinks h
    h2 = _tokens_at_scale(0.2, (1, 4, 16)).requires_grad_(True)
    scale_loss(h2, 1.0, lam=1.0).backward()
    cos2 = torch.nn.functional.cosine_similarity(h2.grad[0], h2.detach()[0], dim=-1)
    assert torch.allclose(cos2, -torch.ones(4, dtype=cos2.dtype), atol=1e-6)  # against h: a step grows h


def test_bad_arguments():
    h = torch.ones(2, 4)
    with pytest.raises(ValueError):
        scale_loss(h, 0.0, 0.1)
    with pytest.raises(ValueError):
        scale_loss(h, 1.0, -0.1)
