import pytest
import torch

from models.decoder import Decoder, DecoderConfig
from models.norms import TaperGate, TaperNorm
from train.calibration import branch_mismatch, calibrate


def _activations(seed=0, n=64, d=24):
    g = torch.Generator().manual_seed(seed)
    # tokens of very different scales: the least-squares c is not simply 1 / mean rms
    scales = torch.exp(torch.randn(n, 1, generator=g))
    return torch.randn(n, d, generator=g) * scales + 0.3


def _layer(d=24, seed=1):
    layer = TaperNorm(d, TaperGate(1.0))
    with torch.no_grad():
        layer.weight.copy_(torch.rand(d, generator=torch.Generator().manual_seed(seed)) * 2 + 0.1)
        layer.weight_tilde.fill_(0.5)
    return layer


def test_c_is_the_closed_form_least_squares_optimum():
    h = _activations()
    layer = _layer()
    gamma = layer.weight.detach().double()
    x = (h.double() * gamma).reshape(-1, 1)                                   # linear branch per unit c
    y = (h.double() / h.double().pow(2).mean(-1, keepdim=True).add(layer.eps).sqrt() * gamma).reshape(-1, 1)
    c_lstsq = torch.linalg.lstsq(x, y).solution.item()                        # brute-force solver
    c = layer.calibrate([h[:20], h[20:]])                                     # accumulated over two batches
    assert c == pytest.approx(c_lstsq, rel=1e-6)
    assert torch.equal(layer.weight_tilde, layer.weight)                      # gamma_tilde starts from gamma

    @torch.no_grad()
    def mismatch(cv):
        return float((layer.normalized(h).double() - cv * h.double() * gamma).pow(2).sum())
    best = mismatch(c)
    for cv in (c * 0.99, c * 1.01, c * 0.5, 1.0):                             # any other c is worse
        assert mismatch(cv) > best
    residual = float((y - x * c_lstsq).pow(2).sum())
    assert best == pytest.approx(residual, rel=1e-6)


def test_model_calibration_captures_real_inputs_and_reaches_the_optimum():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=64, d_model=16, n_layer=2, n_head=2, max_seq_len=16,
                                  norm="taper", taper_scope="all"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                p.copy_(torch.rand_like(p) + 0.5)
    batches = [torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    model.set_gate(0.4)                                   # calibration runs the real branch whatever the gate
    captured = {name: [] for name in model.taper_layers()}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=name: captured[n].append(a[0].clone()))
             for name, m in model.taper_layers().items()]
    model.set_gate(1.0)
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    model.set_gate(0.4)

    before = branch_mismatch(model, batches)
    c = calibrate(model, batches)
    after = branch_mismatch(model, batches)
    assert model.gate.value == 0.4                        # restored
    assert set(c) == {"blocks.0.ln_1", "blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2", "ln_f"}
    for name, layer in model.taper_layers().items():
        h = torch.cat([a.reshape(-1, 16) for a in captured[name]]).double()
        gamma = layer.weight.detach().double()
        with torch.no_grad():
            x, y = (h * gamma).reshape(-1, 1), (layer.normalized(h.float()).double()).reshape(-1, 1)
        c_star = torch.linalg.lstsq(x, y).solution.item()
        assert c[name] == pytest.approx(c_star, rel=1e-5)
        assert after[name] == pytest.approx(float((y - c_star * x).pow(2).sum()), rel=1e-4)
        assert after[name] < before[name]


def test_in_order_calibration_fits_each_norm_to_what_it_sees_at_gate_zero():
    """calibrate_in_order: one forward, each norm calibrated then switched to g = 0 at once, so each c is the
    least-squares optimum on the very inputs the norm gets at g = 0 (QK-norms and sandwich norms included)."""
    from tests.helpers import random_model
    from train.calibration import calibrate_in_order
    model = random_model(seed=2, norm="taper", taper_scope="all", pos_embedding="rope", mlp="swiglu", n_layer=3,
                         norm_layout="sandwich", qk_norm="head")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    c = calibrate_in_order(model, ids)
    assert model.gate.value == 0.0 and set(c) == set(model.cfg.norm_names())
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, n=name: seen.__setitem__(n, m.calibration_terms(a[0])))
             for name, layer in model.taper_layers().items()]
    with torch.no_grad():
        model(ids)                                   # at g = 0: the inputs each norm really gets
    for h in hooks:
        h.remove()
    for name, (num, den) in seen.items():
        assert num / den == pytest.approx(c[name], rel=1e-9), name
    assert all(torch.equal(m.weight_tilde, m.weight) for m in model.taper_layers().values())
