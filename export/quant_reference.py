"""The torch reference of a quantized graph: the folded model with each quantized weight replaced by
exactly what the graph's blocks hold (dequantized), read one block at a time.

    parts = QuantizedParts(source, plan)                  # plan: export.stream.GraphPlan with --quantize
    layerwise_run(source, sessions, parts=parts)          # models/layerwise.py

Against the float model a quantized graph drifts by what rounding costs, which depends on the
model (a trained one keeps its top-1 choices; a random-init one of real size does not: its int4
logits move by half their scale) and so cannot tell a correct graph from a broken one. Against
this reference the only difference left is how the kernels compute (MatMulNBits' int8
activations at accuracy level 4, summation order), so a wrong block layout, axis, scale or
table shows as a difference of the outputs' own size. The blocks are those of ONNX Runtime's
quantizer run on each matrix alone (export/stream.py `quantize_one`), dequantized here:

    MatMulNBits   B [N, K/block, block * bits / 8], scales [N, K/block]: w = (q - 2^(bits-1)) * scale
    Gather (int4) data [V, d] signed int4, scales [V, d/block]:        e = q * scale

Zero points (asymmetric, --algo hqq) are not followed: such graphs are checked against the
float model only (export/streamed.py says so).
"""
from __future__ import annotations

import numpy as np
import torch
from onnx import numpy_helper

from models.layerwise import ModelParts


class UnsupportedDequantization(Exception):
    """Blocks this module does not dequantize (zero points)."""


def dequantize(x: np.ndarray, op: str, bits: int, qcfg) -> np.ndarray:
    """What the graph holds for the float matrix `x` after quantization, in x's own layout for a
    table (op Gather, MatMulT: x is E [V, d]) and transposed for a MatMul weight (x [K, N] ->
    [N, K], nn.Linear's layout)."""
    from export.stream import Quantized, quantize_one
    out = quantize_one(x, Quantized("", op, 0, bits), qcfg)
    if 3 in out:
        raise UnsupportedDequantization("zero points")
    if op == "Gather":
        data = numpy_helper.to_array(out[0]).astype(np.float32)                  # [V, d]
        scales = numpy_helper.to_array(out[2]).astype(np.float32)                # [V, d / block]
        data *= np.repeat(scales, qcfg.block_size, axis=1)[:, :data.shape[1]]    # in place: a real table is GBs
        return data
    blocks = numpy_helper.to_array(out[1])                                        # [N, K/block, blob] uint8
    n, k_blocks, _ = blocks.shape
    if bits == 4:      # two values a byte, the low nibble first
        q = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(n, k_blocks, -1)
    else:
        q = blocks
    scales = numpy_helper.to_array(out[2]).astype(np.float32).reshape(n, k_blocks)
    w = q.astype(np.float32)                                                      # [N, K/block, block]
    w -= 1 << (bits - 1)                                  # in place, as (q - 2^(bits-1)) * scale: no more copies
    w *= scales[:, :, None]
    k = x.shape[1] if op == "MatMulT" else x.shape[0]
    return w.reshape(n, -1)[:, :k]                                                # [N, K]


class QuantizedParts(ModelParts):
    """The folded model (as the streamed build writes it) with its quantized weights dequantized."""

    def __init__(self, source, plan):
        from export.stream import Quantized, Rows
        super().__init__(source)
        self.plan = plan
        self.specs: dict[str, tuple[str, int]] = {}          # our parameter -> (op, bits)
        for recipe in plan.recipes.values():
            if isinstance(recipe, Quantized):
                fp = plan.float_recipes[recipe.source]
                for p in fp.params if isinstance(fp, Rows) else []:
                    self.specs[p] = (recipe.op, recipe.bits)
        self._tied_table = None

    def _weight(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """w (nn.Linear [out, in] or a table [V, d]) as the graph holds it."""
        op, bits = self.specs.get(name, (None, 0))
        if op is None:
            return w
        from export.stream import transposed
        x = w.detach().float().numpy()
        x = transposed(x) if op == "MatMul" else x
        return torch.from_numpy(np.ascontiguousarray(dequantize(x, op, bits, self.plan.quantize)))

    def block(self, i: int) -> torch.nn.Module:
        from models.fold import fold_block_norms
        block = self.source.block(i)
        fold_block_norms(block)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(self._weight(f"blocks.{i}.{name}", p))
        return block

    def _top(self):
        """The model's embedding, positions, final norm and head (folded); read when asked for, not
        kept: each table of a real model is a GB."""
        from export.stream import load_top
        return load_top(self.source, fuse=self.plan.fuse)

    def _tied(self, top) -> bool:
        # a tied head is the embedding's tensor: its blocks were traced under the embedding's name
        return top.lm_head.weight is top.wte.weight and "lm_head.weight" not in self.specs

    def embedding(self) -> torch.Tensor:
        top = self._top()
        table = self._weight("wte.weight", top.wte.weight)
        self._tied_table = table if self._tied(top) else None      # the head is the same matrix: kept once
        return table

    def positions(self) -> torch.Tensor:
        return self._top().wpe.weight

    def final(self):
        top = self._top()
        bias = top.lm_head.bias                     # a final norm's shift folded into the head (None: none)
        if self._tied(top):
            head = self._tied_table if self._tied_table is not None else self._weight("wte.weight", top.lm_head.weight)
            self._tied_table = None
            return top.ln_f, head, bias
        return top.ln_f, self._weight("lm_head.weight", top.lm_head.weight), bias
