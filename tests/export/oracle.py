"""The test oracle: torch.onnx.export of the reference decoder with its fixed-capacity KV cache.

export.build emits its graphs from the model's spec (export/emit.py); tests/export/test_emit.py holds
them to this export, torch's own, on every model the decoder can be, and tests that want a graph the
way torch writes it (graph passes on foreign exporters' structure) use it too.


The graph's decode-step contract (one graph serves prefill and decode):

    inputs   input_ids   int64 [batch, seq]          tokens to run
             position    int64 [batch]               cache slot of each sequence's first token
             key_{i}     float [batch, H, S_max, D]  layer i key cache   (i = 0 .. n_layer-1)
             value_{i}   float [batch, H, S_max, D]  layer i value cache
    outputs  logits      float [batch, seq, vocab]
             present_key_{i}, present_value_{i}      the caches with the new tokens written

Every Squeeze gets an explicit `axes` input where its input shape is static (the
exporter writes Squeeze(Shape(input_ids)[1:2]) without axes for the sequence length,
which TensorRT's parser takes only from 11.5 on: `explicit_squeeze_axes`).

The cache write is one opset-24 TensorScatter per cache (axis -2, linear mode):
bind one buffer as both key_i and present_key_i and ONNX Runtime / TensorRT
update it in place. torch's own exporter would lower the write to
Transpose + ScatterND + Transpose (a full copy per step), hence the custom op
(models/kv_cache.py) and its translation below (shared/design/METHOD.md s. 4).
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from onnxscript.onnx_opset import opset24 as op

from core.contract import (CACHE_KINDS, INPUT_IDS, LOGITS, POSITION, DecodeContract, cache_name, io_names, np_dtype,
                           present_name)
from core.decode import Step
from export.emit import META_PREFIX, OPSET, model_metadata
from models.decoder import TORCH_DTYPES, Decoder

DTYPES = ("fp32", "fp16")          # what torch exports (a bf16 graph: export/emit.py retypes the fp16 one)


ATTENTION = ("plain", "fused")     # plain ops (portable) | one opset-24 Attention op per layer


def cache_write_onnx(cache, update, pos):
    return op.TensorScatter(cache, update, pos, axis=-2)


def attention_onnx(q, k, v, mask, scale: float = 0.0, softcap: float = 0.0):
    """models/attention.py's op: softmax(cap(q k^T * scale) where mask) v; scale 0 is ONNX's default
    1 / sqrt(D) and softcap 0 none, so those stay unwritten (the graph of a model without them is unchanged)."""
    attrs = {name: value for name, value in (("scale", scale), ("softcap", softcap)) if value}
    return op.Attention(q, k, v, mask, **attrs)[0]      # Y; the optional present / qk outputs are dropped below


class _DecodeStep(torch.nn.Module):
    """Flat-argument wrapper: (input_ids, position, caches) -> (logits, caches)."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position, cache):
        logits, new_cache = self.model(input_ids, position, list(cache))
        return logits, tuple(new_cache)


def example_inputs(model: Decoder, batch: int = 2, seq: int = 3, dtype=torch.float32):
    # sizes other than 0 and 1, or torch.export specializes those dimensions
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    position = torch.zeros(batch, dtype=torch.long)
    cache = tuple(cfg.cache_layout().allocate(batch, dtype=dtype))
    return ids, position, cache


def explicit_squeeze_axes(proto: onnx.ModelProto) -> int:
    """Give each axis-less Squeeze whose input has a static shape an explicit `axes` input
    (the positions of its size-1 dims: exactly what it squeezes). Returns how many it changed.

    Squeeze without axes removes every dim of size 1; with the shape known that set is
    fixed, so the rewrite is exact. A Squeeze over a shape with a symbolic dim is left
    as it is (that dim may be 1 at run time); graph_passes' TensorRT lint flags it.
    """
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:          # axes became an input at opset 13
        return 0
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:   # > 2 GB or an op shape inference does not know: leave the graph as it is
        return 0
    g = inferred.graph
    shapes = {v.name: v.type.tensor_type.shape for v in [*g.value_info, *g.input, *g.output]
              if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
    changed = 0
    for node in proto.graph.node:
        if node.op_type != "Squeeze" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
            continue
        shape = shapes.get(node.input[0])
        dims = [d.dim_value if d.HasField("dim_value") else None for d in shape.dim] if shape is not None else [None]
        if None in dims:
            continue
        name = f"{node.name or node.output[0]}_axes"
        proto.graph.initializer.append(numpy_helper.from_array(
            np.array([i for i, d in enumerate(dims) if d == 1], np.int64), name))
        node.input.append(name)
        changed += 1
    return changed


def _drop_unused_outputs(proto: onnx.ModelProto, op_type: str) -> None:
    """Trailing optional outputs nothing reads are removed, so the kernel does not compute
    them (Attention's present_key / present_value would copy the whole cache each step)."""
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    for n in proto.graph.node:
        if n.op_type == op_type:
            while len(n.output) > 1 and n.output[-1] not in used:
                n.output.pop()


EXPORTER_LOGGERS = {"torch.onnx._internal.exporter._registration": logging.ERROR, "onnxscript": logging.WARNING,
                    "onnx_ir": logging.WARNING}


def export_onnx(model: Decoder, path: str | Path | None, dtype: str = "fp32",
                attention: str = "plain") -> onnx.ModelProto:
    """Export `model` (not modified) to `path` (None: not saved) and return the ONNX model. attention: "plain"
    (the portable form) or "fused" (one ONNX Attention op per layer, models/attention.py)."""
    from models.attention import fused_attention_export
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPES)}")
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}; expected one of {', '.join(ATTENTION)}")
    model = model.eval()
    torch_dtype = TORCH_DTYPES[dtype]
    if torch_dtype != torch.float32:
        import copy
        model = copy.deepcopy(model).to(torch_dtype)
    inputs = example_inputs(model, dtype=torch_dtype)
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1, max=model.cfg.max_seq_len)
    dynamic_shapes = {INPUT_IDS: {0: batch, 1: seq}, POSITION: {0: batch},
                      "cache": tuple(({0: batch}, {0: batch}) for _ in range(model.cfg.n_layer))}
    in_names, out_names = io_names(model.cfg.n_layer)
    # the exporter prints its own progress lines, and its optimizer logs INFO lines wherever the root
    # logger is at INFO (ONNX Runtime's quantizer, GenAI's builder set it on import); keep them out
    for name, level in EXPORTER_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    fused = fused_attention_export() if attention == "fused" else contextlib.nullcontext()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), fused:
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            _DecodeStep(model), inputs, dynamo=True, opset_version=OPSET,
            dynamic_shapes=dynamic_shapes, input_names=in_names, output_names=out_names,
            custom_translation_table={torch.ops.tapernorm.cache_write.default: cache_write_onnx,
                                      torch.ops.tapernorm.attention.default: attention_onnx},
            verbose=False)
    proto = program.model_proto
    explicit_squeeze_axes(proto)
    _drop_unused_outputs(proto, "Attention")
    for k, v in {**model_metadata(model, dtype), META_PREFIX + "attention": attention}.items():
        proto.metadata_props.add(key=k, value=v)
    if path is not None:
        from core.onnx_writer import save_onnx
        save_onnx(proto, path)
    return proto


# --- the torch reference run on a decode session (a whole model in memory) ---------------------------

def run_torch(model, iface: DecodeContract, steps: list[Step], dtype=None) -> list[dict[str, np.ndarray]]:
    """The reference: the torch Decoder on the same session (cache written in place); `dtype` (a torch
    dtype) the model's and caches' when the model was cast (float64: rounding_slack), else the graph's."""
    import torch
    from models.decoder import TORCH_DTYPES
    dtype = dtype or TORCH_DTYPES[iface.dtype]
    batch = steps[0].input_ids.shape[0]
    cache = model.cfg.cache_layout().allocate(batch, dtype=dtype)
    results = []
    with torch.no_grad():
        for step in steps:
            logits, cache = model(torch.from_numpy(step.input_ids), torch.from_numpy(step.position), cache)
            results.append({LOGITS: logits.float().numpy().astype(np_dtype(iface.dtype)) if dtype != torch.float64
                            else logits.numpy(),
                            **{present_name(cache_name(i, kind)): c.numpy().copy()
                               for i, kv in enumerate(cache) for kind, c in zip(CACHE_KINDS, kv)}})
    return results


def rounding_slack(model, iface: DecodeContract, steps: list[Step], fp32_runs: list[dict]) -> dict[str, float]:
    """Per output, FP32_ROUNDING_SLACK x max |torch fp32 - torch float64| over the steps: what rounding alone
    can move that output by on these inputs (a float64 copy of the model, run once)."""
    import copy
    import torch
    from export.reference_check import rounding_slack_of
    return rounding_slack_of(fp32_runs, run_torch(copy.deepcopy(model).double(), iface, steps, dtype=torch.float64))
