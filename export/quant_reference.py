"""The torch reference of a quantized graph: the folded model with each quantized weight replaced by
exactly what the written graph's blocks hold (dequantized), read one block at a time.

    parts = GraphWeights(source, path)                    # path: the written model.<int8|int4>.onnx
    layerwise_run(source, sessions, parts=parts)          # models/layerwise.py

Against the float model a quantized graph drifts by what rounding costs, which depends on the
model (a trained one keeps its top-1 choices; a random-init one of real size does not: its int4
logits move by half their scale) and so cannot tell a correct graph from a broken one. Against
this reference the only difference left is how the kernels compute (MatMulNBits' int8
activations at accuracy level 4, summation order), so a wrong block layout, axis, scale or
table shows as a difference of the outputs' own size. The blocks are read from the graph file
itself (its external data, memory-mapped), by the layer each quantized node computes (the node's
provenance, graph_passes.base.PassContext.layer_name), and dequantized (export/rtn.py):

    MatMulNBits           B [N, K/block, blob], scales [N, K/block]: w = (q - 2^(bits-1)) * scale
    GatherBlockQuantized  int4 data [V, d] and scales, or the head's MatMulNBits blocks (a tied table)

The rest of the model (norms, biases) is folded as the graph passes fold it, by models/fold.py, the
torch-side reference of those passes. Zero points (asymmetric, --algo hqq) are not followed: such
graphs are checked against the float model only (export/pipeline.py says so).
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F

from core.contract import INPUT_IDS
from models.layerwise import ModelParts


def initializer_array(folder: Path, t: onnx.TensorProto, copy: bool = True) -> np.ndarray:
    """An initializer's values (4-bit types: their packed bytes), read from its external data file when it has one
    (copy False: a read-only view of the memory-mapped file, for a caller that reads a few rows)."""
    from onnx import numpy_helper
    packed = t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
    if t.data_location != onnx.TensorProto.EXTERNAL:
        values = numpy_helper.to_array(t)           # (4-bit types: one value an element, not their bytes)
        return _packed(values) if packed else _writable(values)
    info = {e.key: e.value for e in t.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    raw = np.memmap(folder / info["location"], dtype=np.uint8, mode="r", offset=int(info.get("offset", 0)),
                    shape=(int(info["length"]),))
    if packed:
        return np.array(raw) if copy else raw
    values = np.frombuffer(raw, dtype=dtype).reshape(tuple(t.dims))
    return values.copy() if copy else values


def _writable(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable else a.copy()


def _packed(values: np.ndarray) -> np.ndarray:
    """4-bit values as ONNX stores them: two a byte, element 2i in the low nibble (a 0 nibble after an odd count)."""
    nibbles = values.reshape(-1).astype(np.int8).view(np.uint8) & 0x0F
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return nibbles[0::2] | (nibbles[1::2] << 4)


def dequantized_rows(B: np.ndarray, scales: np.ndarray, k: int, bits: int, block: int) -> torch.Tensor:
    """export.rtn.dequantize_matmul's weight as nn.Linear holds it ([N, K]), computed by torch (its threads):
    (q - 2^(bits-1)) * scale in fp32, the same products (tests/export/test_quant_reference.py)."""
    b = torch.from_numpy(B)                                                      # [N, K/block, blob] uint8
    n, k_blocks, _ = b.shape
    q = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(n, k_blocks, block) if bits == 4 else b
    w = q.to(torch.float32).sub_(1 << (bits - 1)).mul_(torch.from_numpy(scales).reshape(n, k_blocks, 1))
    return w.reshape(n, k_blocks * block)[:, :k].contiguous()


class GraphWeights(ModelParts):
    """The folded model (as the graph passes fold it) with the weights the graph quantized dequantized."""

    def __init__(self, source, path: Path):
        from graph_passes.base import PassContext
        super().__init__(source)
        self.folder = Path(path).parent
        proto = onnx.load(str(path), load_external_data=False)
        ctx = PassContext(proto)
        inits = {t.name: t for t in proto.graph.initializer}
        made_by = {o: n for n in proto.graph.node for o in n.output}
        self.inits = inits
        self.matmuls: dict[str, tuple] = {}           # layer -> (B, scales, K, bits, block)
        self.table = None                             # the embedding's dequantization recipe
        nodes = {n.name: n for n in ctx.graph.nodes}
        for node in proto.graph.node:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "MatMulNBits" and (len(node.input) < 4 or not node.input[3]):     # no zero points
                self.matmuls[ctx.layer_name(nodes[node.name])] = (node.input[1], node.input[2], attrs["K"],
                                                                  attrs["bits"], attrs["block_size"])
            elif node.op_type == "GatherBlockQuantized" and node.input[1] == INPUT_IDS:
                data, scales = (self._through_reshape(made_by, n) for n in (node.input[0], node.input[2]))
                self.table = (data, scales, attrs.get("bits", 4), attrs["block_size"])

    def _through_reshape(self, made_by: dict, name: str) -> str:
        node = made_by.get(name)
        return node.input[0] if node is not None and node.op_type == "Reshape" else name

    def _matmul(self, layer: str) -> torch.Tensor | None:
        """The dequantized weight of `layer`'s MatMulNBits, nn.Linear's layout [N, K]; None: not quantized."""
        if layer not in self.matmuls:
            return None
        b, scales, k, bits, block = self.matmuls[layer]
        return dequantized_rows(self._array(b), self._array(scales), k, bits, block)

    def _array(self, name: str) -> np.ndarray:
        return initializer_array(self.folder, self.inits[name])

    def block(self, i: int) -> torch.nn.Module:
        from models.fold import fold_block_norms
        cfg = self.cfg
        packed = self._matmul(f"blocks.{i}.attn.qkv_proj")          # Q, K, V in one MatMul (--attention gqa)
        if packed is not None:
            sizes = [cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
            graph = dict(zip(("attn.q_proj", "attn.k_proj", "attn.v_proj"), torch.split(packed, sizes)))
        else:
            graph = {}
        skeleton = self.skeleton.blocks[i]
        for name, module in skeleton.named_modules():
            if isinstance(module, torch.nn.Linear) and name not in graph:
                w = self._matmul(f"blocks.{i}.{name}")
                if w is not None:
                    graph[name] = w
        if self._shifts():                  # a fold's shift reads the float weights (b' = b + W shift)
            block = self.source.block(i)
            fold_block_norms(block)         # the norms and biases as the graph passes fold them
        else:                               # the weights the graph quantized are not read: they are replaced
            block = copy.deepcopy(skeleton).to_empty(device="cpu")
            with torch.no_grad():
                for name, p in block.named_parameters():
                    if name.removesuffix(".weight") not in graph:
                        p.copy_(self.source.tensor(f"blocks.{i}.{name}"))
            fold_block_norms(block, weights=False)
        for name, w in graph.items():       # the weights: what the graph holds (already folded there)
            block.get_submodule(name).weight.data = w.contiguous()
        return block.eval()

    def _shifts(self) -> bool:
        """Whether a norm has a shift, which a fold moves into the bias through the float weights."""
        return self.cfg.norm in ("layernorm", "dyt") or (self.cfg.norm == "taper" and self.cfg.taper_affine)

    def _top(self):
        """The model without its blocks (embedding, positions, final norm, head), the final norm folded as the
        graph passes fold it; read when asked for, not kept: each table of a real model is a GB. With a quantized
        head, no head bias and no shift to fold, only the final norm is read: the float tables would be replaced
        unread (they stay on the meta device, where the fold's arithmetic on them costs nothing)."""
        from models.fold import fold_final_norm
        top = copy.deepcopy(self.skeleton)
        top.blocks = torch.nn.ModuleList()
        if "lm_head" in self.matmuls and top.lm_head.bias is None and not self._shifts():
            if any(True for _ in top.ln_f.parameters()):
                top.ln_f = self.source.fill(top.ln_f, "ln_f.")
        else:
            top = self.source.fill(top, "")
        fold_final_norm(top, keep_tied=True)
        return top

    def embedding(self) -> torch.Tensor:
        return super().embedding() if self.table is None else self._table_rows()

    def embedded(self, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's dequantized embedding rows of the tokens asked for, those rows alone read and dequantized
        (the whole table is ~1 GB in fp32 on a real model, for a few dozen tokens); a table whose rows do not
        start on a byte (an int4 table of odd width) is dequantized whole."""
        if self.table is None or (self.inits[self.table[0]].data_type == onnx.TensorProto.INT4
                                  and self.inits[self.table[0]].dims[1] % 2):
            return super().embedded(ids)
        wanted = torch.unique(torch.cat([i.reshape(-1) for i in ids]))              # sorted
        table = self._table_rows(wanted.numpy())
        return [F.embedding(torch.searchsorted(wanted, i), table) for i in ids]

    def _table_rows(self, rows: np.ndarray | None = None) -> torch.Tensor:
        """The graph's dequantized embedding table [V, d], or only its `rows` (read and dequantized alone):
        GatherBlockQuantized's int4 codes [V, d], two a byte, or the head's MatMulNBits blocks [V, d/block, blob]
        of E^T (a tied table), whose row v's blocks are B[v]."""
        from export.rtn import dequantize_gather
        data, scales, bits, block = self.table
        t = self.inits[data]
        pick = slice(None) if rows is None else rows
        codes = initializer_array(self.folder, t, copy=False)
        row_scales = np.array(initializer_array(self.folder, self.inits[scales], copy=False)[pick])
        if t.data_type == onnx.TensorProto.INT4:
            v, d = t.dims
            picked = codes if rows is None else codes.reshape(v, d // 2)[rows]
            return torch.from_numpy(dequantize_gather(picked, row_scales, (v if rows is None else len(rows), d), block))
        return dequantized_rows(np.array(codes[pick]), row_scales, self.cfg.d_model, bits, block)

    def final(self):
        top = self._top()
        head = self._matmul("lm_head")
        return top.ln_f, top.lm_head.weight.detach() if head is None else head, top.lm_head.bias
