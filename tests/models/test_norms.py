"""Numerical checks of the norm layers against their formulas (fp32 tolerances stated per test)."""
import pytest
import torch

from models.norms import DyT, LayerNorm, RMSNorm, TaperGate, TaperNorm

D = 16


def taper(gate=1.0, **kw):
    torch.manual_seed(0)
    t = TaperNorm(D, TaperGate(gate), **kw)
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(torch.randn_like(p))
    t.c = 0.37
    return t


def test_taper_at_gate_one_equals_rmsnorm():
    t, rms = taper(1.0), RMSNorm(D)
    with torch.no_grad():
        rms.weight.copy_(t.weight)
    h = torch.randn(3, 5, D) * 3
    torch.testing.assert_close(t(h), rms(h), atol=1e-6, rtol=0)


def test_taper_ln_base_at_gate_one_equals_layernorm():
    t, ln = taper(1.0, base="ln", affine=True), LayerNorm(D)
    with torch.no_grad():
        ln.weight.copy_(t.weight), ln.bias.copy_(t.bias)
    h = torch.randn(4, D) + 2.0
    torch.testing.assert_close(t(h), ln(h), atol=1e-6, rtol=0)


@pytest.mark.parametrize("affine", [False, True])
def test_taper_at_gate_zero_is_the_linear_map(affine):
    t = taper(0.0, affine=affine)
    h = torch.randn(2, 7, D)
    expected = 0.37 * h * t.weight_tilde + (t.bias_tilde if affine else 0.0)
    torch.testing.assert_close(t(h), expected, atol=1e-6, rtol=0)


def test_taper_blend_between_branches():
    t = taper(0.25)
    h = torch.randn(5, D)
    rms = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + t.eps)
    expected = 0.25 * rms * t.weight + 0.75 * 0.37 * h * t.weight_tilde
    torch.testing.assert_close(t(h), expected, atol=1e-6, rtol=0)


def test_calibration_known_answer_constant_rms():
    # every token has rms exactly 4 (eps ~ 0): the least-squares c is 1/4
    t = TaperNorm(D, TaperGate(1.0), eps=1e-12)
    signs = torch.randint(0, 2, (100, D)).float() * 2 - 1
    c = t.calibrate([signs * 4.0])
    assert c == pytest.approx(0.25, rel=1e-9)
    torch.testing.assert_close(t.weight_tilde, t.weight)


def test_calibration_matches_closed_form_and_lstsq():
    t = taper(1.0)
    batches = [torch.randn(64, D) * s for s in (0.5, 2.0, 7.0)]
    c = t.calibrate(batches)
    h = torch.cat(batches).double()
    g = t.weight.detach().double()
    r = torch.sqrt(h.pow(2).mean(-1) + t.eps)
    closed = ((g * h).pow(2).sum(-1) / r).sum() / (g * h).pow(2).sum()
    assert c == pytest.approx(closed.item(), rel=1e-9)
    # the same c is the least-squares solution of c * (gamma h) ~ gamma h / r
    a = (g * h).reshape(-1, 1)
    b = (g * h / r[:, None]).reshape(-1, 1)
    lstsq = torch.linalg.lstsq(a, b).solution.item()
    assert c == pytest.approx(lstsq, rel=1e-9)
    # and calibration copied gamma into gamma_tilde
    torch.testing.assert_close(t.weight_tilde, t.weight)


def test_dyt_matches_formula():
    m = DyT(D, alpha_init=0.8)
    with torch.no_grad():
        m.weight.copy_(torch.randn(D)), m.bias.copy_(torch.randn(D))
    x = torch.randn(3, D) * 4
    torch.testing.assert_close(m(x), m.weight * torch.tanh(0.8 * x) + m.bias, atol=1e-6, rtol=0)
    assert m.alpha.requires_grad and m.alpha.shape == ()


def test_one_gate_controls_every_layer():
    gate = TaperGate(1.0)
    layers = [TaperNorm(D, gate) for _ in range(3)]
    gate.set(0.0)
    assert all(layer.gate.value == 0.0 for layer in layers)
    with pytest.raises(ValueError, match="outside"):
        gate.set(1.5)
