"""Calibration of every TaperNorm's c at the end of warmup (METHOD.md section 1, step 2).

For each tapered layer, c is the least-squares scalar that makes the linear
branch c * gamma * h match the normalized branch N(h) * gamma on real
activations h (captured with forward pre-hooks at g = 1 on held-out batches):

    c = sum_tokens <N(h) gamma, gamma h> / sum_tokens ||gamma h||^2

and gamma_tilde starts as a copy of gamma, so the switch causes no shift.

Data-parallel training passes `reduce` (train.distributed.Parallel.sum): each rank sums over
its share of the calibration batches, the float64 sums are all-reduced, and every rank
solves for the same c from the same totals.
"""
from __future__ import annotations

import torch

from models.decoder import Decoder


def _reduced(sums: dict[str, list[float]], reduce) -> dict[str, list[float]]:
    """The per-layer sums added over ranks (in one all-reduce), or as they are without `reduce`."""
    if reduce is None:
        return sums
    flat = reduce([x for v in sums.values() for x in v])
    width = len(next(iter(sums.values()), []))
    return {name: flat[i * width:(i + 1) * width] for i, name in enumerate(sums)}


@torch.no_grad()
def calibrate(model: Decoder, batches, reduce=None) -> dict[str, float]:
    """Fix c of every TaperNorm from `batches` (iterable of input_ids [B, T]); returns {layer: c}.

    Runs the model at g = 1 (its real normalized branch), whatever the gate was,
    and restores the gate afterwards. reduce: sums over ranks (this rank's batches may
    then be none).
    """
    layers = model.taper_layers()
    if not layers:
        return {}
    sums = {name: [0.0, 0.0] for name in layers}
    hooks = []
    for name, layer in layers.items():
        def hook(module, args, name=name):
            num, den = module.calibration_terms(args[0])
            sums[name][0] += num
            sums[name][1] += den
        hooks.append(layer.register_forward_pre_hook(hook))
    gate, was_training = model.gate.value, model.training
    model.set_gate(1.0)
    model.eval()
    try:
        n = 0
        for ids in batches:
            model(ids)
            n += 1
        if n == 0 and reduce is None:
            raise ValueError("calibration needs at least one batch")
    finally:
        for h in hooks:
            h.remove()
        model.set_gate(gate)
        model.train(was_training)
    return {name: layers[name].set_calibration(num, den) for name, (num, den) in _reduced(sums, reduce).items()}


@torch.no_grad()
def branch_mismatch(model: Decoder, batches, reduce=None) -> dict[str, float]:
    """Per layer: sum over tokens of ||linear(h) - normalized(h)||^2 at g = 1 inputs (diagnostic)."""
    layers = model.taper_layers()
    out = {name: 0.0 for name in layers}
    hooks = []
    for name, layer in layers.items():
        def hook(module, args, name=name):
            h = args[0]
            out[name] += float((module.linear(h) - module.normalized(h)).double().pow(2).sum())
        hooks.append(layer.register_forward_pre_hook(hook))
    gate = model.gate.value
    model.set_gate(1.0)
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
        model.set_gate(gate)
    return {name: v[0] for name, v in _reduced({k: [v] for k, v in out.items()}, reduce).items()}


@torch.no_grad()
def calibrate_in_order(model: Decoder, ids: torch.Tensor) -> dict[str, float]:
    """c of every TaperNorm from ONE forward over `ids` [B, T], each norm switched to g = 0 the moment it is
    calibrated, so every later norm is calibrated on the activations it will see at g = 0; the model's gate is
    0 after. For a model put at g = 0 at once, with no taper training (a random-init All-Taper model at a real
    shape, bench/fold_vs_genai.py): calibrate() measures every norm at g = 1, and through a few dozen layers
    the linear branches drift from those activations until the logits overflow; calibrated in order, each
    norm's output keeps the normalized branch's scale and the model stays finite."""
    from models.norms import TaperGate
    layers = model.taper_layers()          # in forward order: a block's ln_1, q / k norms, post norms, ln_2, ...
    shared, c, hooks = model.gate, {}, []
    for name, layer in layers.items():
        layer.gate = TaperGate(1.0)        # its own gate for the pass (the shared one is put back below)

        def calibrate_then_switch(module, args, name=name):
            c[name] = module.set_calibration(*module.calibration_terms(args[0]))
            module.gate.set(0.0)           # this forward already takes the linear branch with that c
        hooks.append(layer.register_forward_pre_hook(calibrate_then_switch))
    was_training = model.training
    model.eval()
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
        for layer in layers.values():
            layer.gate = shared
        model.train(was_training)
    model.set_gate(0.0)
    return c
