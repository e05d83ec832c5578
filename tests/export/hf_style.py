"""Graphs in the I/O conventions of other exporters, built in code (no checked-in .onnx files).

`kv_cache_decoder` is a toy decoder in Optimum's / ONNX Runtime GenAI's convention,
small enough to read, whose logits depend on every input (tokens, mask, positions,
the past), so a driver that feeds any of them wrongly changes the outputs.
`hf_export` exports tiny random-init transformers models with torch.onnx (dynamo).
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

V, H, D = 11, 1, 4        # vocab, kv heads, head dim of the toy


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _body(past: bool, gamma_scale: float = 1.0) -> tuple[list, list[str]]:
    """Nodes computing logits and present.0.key/value from the inputs (and the past when `past`).

        e = E[input_ids]                          [B, T, D]
        present.0.key   = Concat(past.key, e[:, None])        [B, 1, P+T, D]
        present.0.value = Concat(past.value, 2 e[:, None])
        h = e + sum_s present.0.key + 0.01 * position_ids + 0.001 * sum(attention_mask)
        logits = (h * gamma) @ W                  [B, T, V]
    """
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["e"]),
        helper.make_node("Unsqueeze", ["e", "ax1"], ["k_new"]),
        helper.make_node("Mul", ["k_new", "two"], ["v_new"]),
    ]
    if past:
        nodes += [helper.make_node("Concat", ["past_key_values.0.key", "k_new"], ["present.0.key"], axis=2),
                  helper.make_node("Concat", ["past_key_values.0.value", "v_new"], ["present.0.value"], axis=2)]
    else:
        nodes += [helper.make_node("Identity", ["k_new"], ["present.0.key"]),
                  helper.make_node("Identity", ["v_new"], ["present.0.value"])]
    nodes += [
        helper.make_node("ReduceSum", ["present.0.key", "ax12"], ["ctx"], keepdims=0),          # [B, D]
        helper.make_node("Unsqueeze", ["ctx", "ax1"], ["ctx3"]),                                # [B, 1, D]
        helper.make_node("Cast", ["position_ids"], ["pos_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pos_f", "ax_last"], ["pos3"]),                          # [B, T, 1]
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["mask_f", "ax1"], ["mask_n"], keepdims=1),              # [B, 1]
        helper.make_node("Unsqueeze", ["mask_n", "ax_last"], ["mask3"]),                        # [B, 1, 1]
        helper.make_node("Mul", ["pos3", "c_pos"], ["pos_term"]),
        helper.make_node("Mul", ["mask3", "c_mask"], ["mask_term"]),
        helper.make_node("Add", ["e", "ctx3"], ["h1"]),
        helper.make_node("Add", ["h1", "pos_term"], ["h2"]),
        helper.make_node("Add", ["h2", "mask_term"], ["h"]),
        helper.make_node("Mul", ["h", "gamma"], ["hn"], name="norm_gamma_mul"),
        helper.make_node("MatMul", ["hn", "W"], ["logits"], name="lm_head"),
    ]
    return nodes, ["logits", "present.0.key", "present.0.value"]


def _weights(seed: int, gamma_scale: float) -> list:
    rng = np.random.default_rng(seed)
    return [_init("E", rng.normal(size=(V, D)).astype(np.float32)), _init("W", rng.normal(size=(D, V)).astype(np.float32)),
            _init("gamma", (rng.normal(size=D) * 0.3 + 1).astype(np.float32) * np.float32(gamma_scale)),
            _init("two", np.float32(2.0)), _init("c_pos", np.float32(0.01)), _init("c_mask", np.float32(0.001)),
            _init("ax1", np.array([1], np.int64)), _init("ax12", np.array([1, 2], np.int64)),
            _init("ax_last", np.array([-1], np.int64))]


def _io(past: bool, merged: bool):
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
           helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    if past:
        ins += [helper.make_tensor_value_info(f"past_key_values.0.{kv}", TensorProto.FLOAT, ["batch", H, "past", D])
                for kv in ("key", "value")]
    if merged:
        ins.append(helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1]))
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", V])] + \
           [helper.make_tensor_value_info(f"present.0.{kv}", TensorProto.FLOAT, ["batch", H, "total", D])
            for kv in ("key", "value")]
    return ins, outs


def kv_cache_decoder(past: bool = True, merged: bool = False, seed: int = 0, gamma_scale: float = 1.0) -> onnx.ModelProto:
    """The toy in the Optimum convention: with past inputs, without (prefill only), or merged
    (If on use_cache_branch: the then-branch reads the past, the else-branch ignores it)."""
    ins, outs = _io(past or merged, merged)
    if not merged:
        nodes, _ = _body(past)
        graph = helper.make_graph(nodes, "toy", ins, outs, initializer=_weights(seed, gamma_scale))
    else:
        def branch(with_past: bool, tag: str):
            nodes, names = _body(with_past)
            # small constants live in each branch (as a TorchScript export writes them), the weights outside
            nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in _weights(seed, gamma_scale)
                     if t.name not in ("E", "W", "gamma")] + nodes
            rename = {o: f"{o}_{tag}" for node in nodes for o in node.output}     # names unique in the model
            for i, node in enumerate(nodes):
                node.output[:] = [rename.get(o, o) for o in node.output]
                node.input[:] = [rename.get(t, t) for t in node.input]
                node.name = f"{node.name or node.op_type + str(i)}_{tag}"
            return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(rename[n], TensorProto.FLOAT, None)
                                                      for n in names])
        node = helper.make_node("If", ["use_cache_branch"], ["logits", "present.0.key", "present.0.value"],
                                name="optimum::if", then_branch=branch(True, "with_past"),
                                else_branch=branch(False, "no_past"))
        graph = helper.make_graph([node], "toy_merged", ins, outs,
                                  initializer=[t for t in _weights(seed, gamma_scale) if t.name in ("E", "W", "gamma")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def logits_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with only the logits output (a plain export)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [o for o in out.graph.output if o.name == "logits"]
    del out.graph.output[:]
    out.graph.output.extend(keep)
    return out


# --- tiny transformers models exported by torch.onnx (dynamo) ---------------------------------------

HF_KINDS = ("gpt2", "llama", "qwen2")
N_LAYER = 2
NORMS_PER_MODEL = 2 * N_LAYER + 1          # two pre-norms per block and the final norm
# LN-free gains: FakeLN stores gamma * sqrt(eps) / std_l so that the norm still scales to unit size;
# the residual stream of these random-init models has std ~0.02
LN_FREE_INV_STD = 50.0


def hf_model(kind: str, ln_eps: float | None = None):
    """A tiny random-init transformers causal LM with randomized norm gains (and GPT-2 biases), in eval mode.

    ln_eps (GPT-2 only): the LayerNorm eps; 1e12 with gains scaled by 1e6 is the
    LN-free (FakeLN) checkpoint layout, whose norms are a fixed linear map.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(HF_KINDS.index(kind))
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=N_LAYER, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=32)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=N_LAYER, n_head=2,
                                           layer_norm_epsilon=ln_eps or 1e-5))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**small))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**small))
    gain = 1.0 if ln_eps is None else float(np.sqrt(ln_eps)) * LN_FREE_INV_STD      # LN-free: a fixed scale ~1/std
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name or "norm" in name:                  # something to fold: not ones and zeros
                if name.endswith("weight"):
                    p.copy_((torch.randn_like(p) * 0.2 + 1.0) * gain)
                else:
                    p.copy_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):                           # GPT-2 initializes them to 0: a trained model's are not
                p.copy_(torch.randn_like(p) * 0.02)
    model.config.use_cache = False
    return model.eval()


@functools.lru_cache(maxsize=None)
def hf_export(kind: str, opset: int, ln_eps: float | None = None) -> onnx.ModelProto:
    """input_ids [batch, seq] -> logits, exported by torch.onnx.export(dynamo=True) as a user would."""
    import logging

    import torch
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

    class LogitsOnly(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    wrapper = LogitsOnly(hf_model(kind, ln_eps)).eval()
    ids = torch.randint(0, 64, (2, 5))                           # sizes other than 0 and 1: not specialized
    dims = {"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}}
    program = torch.onnx.export(wrapper, (ids,), dynamo=True, opset_version=opset, input_names=["input_ids"],
                                output_names=["logits"], dynamic_shapes=dims, verbose=False)
    return program.model_proto
