"""The decoder I/O conventions export.verify can drive, detected from a graph's inputs and outputs.

| convention | inputs | outputs | driven as |
|---|---|---|---|
| ours (core/contract.py) | input_ids, position, key_i / value_i [B, H, S_max, D] | logits, present_key_i / present_value_i | prefill, then one-token steps, caches fed back: core/decode.py |
| kv-cache (Optimum, ONNX Runtime GenAI) | input_ids, attention_mask, [position_ids], past_key_values.N.key / .value [B, H, P, D], [use_cache_branch] | logits, present.N.key / .value [B, H, P+T, D] | prefill with an empty past (W slots for a sliding-window cache: sliding_window_caches), then one-token steps, presents fed back |
| prefill-only (Optimum without past) | input_ids, [attention_mask], [position_ids] | logits, present.N.key / .value | the growing prefix, recomputed each step |
| logits-only | input_ids, [attention_mask], [position_ids] | logits | the growing prefix, recomputed each step |

A merged decoder (Optimum's If on use_cache_branch) is a kv-cache graph:
use_cache_branch is False for the prefill, True for the steps after it. Two graphs' I/O
are matched by name (interface_mismatches), never by position. Every
output of every step is returned, so every one is compared. `detect` raises one
line naming what it found and the conventions it knows.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from core.contract import (CACHE_DTYPES, CACHE_PREFIX, POSITION, ContractError, DecodeContract, TensorSpec, np_dtype,
                           onnx_io, read_contract, tensor_specs)
from core.decode import Step, graph_step, run_steps, run_steps_in_place, token_steps

PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
PRESENT = re.compile(r"present\.(\d+)\.(key|value)$")
HF_TOKENS = ("input_ids", "attention_mask", "position_ids")
KNOWN = ("known conventions: ours (input_ids, position, key_i/value_i -> logits, present_key_i/present_value_i); "
         "Optimum / ONNX Runtime GenAI (input_ids, attention_mask, [position_ids], past_key_values.N.key|value "
         "[, use_cache_branch] -> logits, present.N.key|value; with or without past); "
         "logits-only (input_ids [, attention_mask, position_ids] -> logits)")


# --- ours: the export contract -----------------------------------------------------------------

def session_steps(iface: DecodeContract, seed: int = 0, batch: int = 2, prompt: int = 5, decode: int = 3,
                  tokens: list[int] | None = None, same_start: bool = False) -> list[Step]:
    """Prefill `prompt` tokens then `decode` one-token steps.

    Random tokens: the sequences of the batch start at different cache slots
    (0 and 2), so per-sequence positions are exercised; with `same_start` every
    sequence starts at slot 0 (graphs whose batched prefill must start there,
    `prefills_from_slot_zero`). Real tokens (`tokens`,
    e.g. a tokenized sentence): every sequence reads the same text from slot 0,
    teacher-forced, so all steps are independent of the outputs compared.
    """
    prompt = max(1, min(prompt, iface.capacity - decode - 2))
    total = prompt + decode
    if tokens is not None:
        toks = np.resize(np.asarray(tokens, dtype=np.int64) % iface.vocab_size, total)
        ids = np.tile(toks, (batch, 1))
        start = np.zeros(batch, dtype=np.int64)
    else:
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, iface.vocab_size, size=(batch, total), dtype=np.int64)
        start = np.minimum(np.arange(batch, dtype=np.int64) * (0 if same_start else 2), iface.capacity - total)
    return token_steps(ids, prompt, start)


def verification_sessions(iface: DecodeContract, tokens: list[int] | None = None, seeds=(0, 1),
                          same_start: bool = False) -> list[tuple[str, list[Step]]]:
    """The labelled sessions a graph is verified on: random tokens per seed (session_steps; same_start
    for a graph whose batched prefills start at slot 0) and, with `tokens`, real text."""
    runs = [(f"random tokens, seed {s}", session_steps(iface, seed=s, same_start=same_start)) for s in seeds]
    if tokens is not None:
        runs.append(("real tokens", session_steps(iface, tokens=tokens)))
    return runs


def run_onnx(sess, iface: DecodeContract, steps: list[Step], trim: int | None = None) -> list[dict[str, np.ndarray]]:
    """Outputs of every step of an ONNX Runtime session, driven by core.decode (see run_steps for `trim`; with it,
    the caches stay in place: run_steps_in_place)."""
    if trim is not None:
        return run_steps_in_place(sess, iface, steps, trim)
    return run_steps(graph_step(sess), iface, steps)


def interface_mismatches(a, b) -> list[str]:
    """How the inputs / outputs (TensorSpecs) of a and b differ: DecodeContracts or HuggingFaceStyles.

    By name, not by position: every run feeds its inputs and reads its outputs by name, so two graphs
    whose inputs are the same set in another order (ours --genai writes past_key_values.N.key|value
    layer by layer, GenAI's builder every key, then every value) drive alike and are compared."""
    out = []
    for kind, xa, xb in (("input", a.inputs, b.inputs), ("output", a.outputs, b.outputs)):
        by_a, by_b = {x.name: x for x in xa}, {x.name: x for x in xb}
        if set(by_a) != set(by_b):
            out.append(f"{kind} names differ: only in the first {sorted(set(by_a) - set(by_b))}, "
                       f"only in the second {sorted(set(by_b) - set(by_a))}")
            continue
        out += [f"{kind} {by_a[n]} vs {by_b[n]}" for n in by_a if by_a[n] != by_b[n]]
    return out


class Ours:
    """The export contract of core/contract.py, driven with a fixed-capacity cache."""
    name = "ours"

    def __init__(self, contract: DecodeContract, same_start: bool = False):
        self.contract = contract
        self.dtype, self.vocab_size = contract.dtype, contract.vocab_size
        self.same_start = same_start         # batched prefills start at slot 0 (prefills_from_slot_zero)

    def describe(self) -> str:
        c = self.contract
        return f"ours ({c.n_layer} layers, cache capacity {c.capacity}, {c.dtype})"

    def mismatches(self, other) -> list[str]:
        return interface_mismatches(self.contract, other.contract)

    def sessions(self, seeds=(0, 1), tokens=None) -> list[tuple[str, list[Step]]]:
        return verification_sessions(self.contract, tokens, seeds, self.same_start)

    def run(self, sess, steps: list[Step]) -> list[dict[str, np.ndarray]]:
        return run_onnx(sess, self.contract, steps)


# --- Hugging Face style: Optimum, ONNX Runtime GenAI, plain logits -------------------------------

@dataclass
class TokenPlan:
    ids: np.ndarray          # int64 [B, prompt + decode]
    prompt: int


class HuggingFaceStyle:
    """input_ids / attention_mask / position_ids, with or without a growing past (see the module table)."""

    def __init__(self, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], vocab_size: int,
                 windows: dict[str, int] | None = None):
        self.inputs, self.outputs, self.vocab_size = inputs, outputs, vocab_size
        self.windows = dict(windows or {})        # past name -> W: a window-sized cache (sliding_window_caches)
        # present name -> W: compare only the last W positions of these presents (set by export.verify
        # when either graph keeps that layer's cache window-sized: see window_view)
        self.compared_windows: dict[str, int] = {}
        names = {t.name for t in inputs}
        self.past = sorted((t for t in inputs if PAST.match(t.name)),      # by layer, then key / value
                           key=lambda t: (int(PAST.match(t.name)[1]), PAST.match(t.name)[2]))
        self.present = [t for t in outputs if PRESENT.match(t.name)]
        self.merged = "use_cache_branch" in names
        self.feeds_mask = "attention_mask" in names
        self.feeds_positions = "position_ids" in names
        self.dtype = next(t for t in outputs if t.name == "logits").dtype
        self.name = "kv-cache" if self.past else ("prefill-only" if self.present else "logits-only")

    def describe(self) -> str:
        if self.past:
            n = len(self.past) // 2
            windowed = sorted(set(self.windows.values()))
            return (f"Optimum/GenAI kv-cache ({n} layers{', merged with use_cache_branch' if self.merged else ''}"
                    + (f", {len(self.windows) // 2} with a sliding-window cache of {'/'.join(map(str, windowed))}"
                       if windowed else "") + f", {self.dtype})")
        if self.present:
            return f"Optimum without past ({len(self.present) // 2} layers, presents out, {self.dtype})"
        return f"logits-only ({self.dtype})"

    def mismatches(self, other) -> list[str]:
        return interface_mismatches(self, other)

    def sessions(self, seeds=(0, 1), tokens=None, batch: int = 2, prompt: int = 5, decode: int = 3):
        total = prompt + decode
        runs = []
        for s in seeds:
            ids = np.random.default_rng(s).integers(0, self.vocab_size, size=(batch, total), dtype=np.int64)
            runs.append((f"random tokens, seed {s}", TokenPlan(ids, prompt)))
        if tokens is not None:
            toks = np.resize(np.asarray(tokens, dtype=np.int64) % self.vocab_size, total)
            runs.append(("real tokens", TokenPlan(np.tile(toks, (batch, 1)), prompt)))
        return runs

    def _feeds(self, ids: np.ndarray, past_len: int) -> dict[str, np.ndarray]:
        batch, t = ids.shape
        feeds = {"input_ids": ids}
        if self.feeds_mask:
            feeds["attention_mask"] = np.ones((batch, past_len + t), np.int64)      # [B, P + T]
        if self.feeds_positions:
            feeds["position_ids"] = np.tile(np.arange(past_len, past_len + t, dtype=np.int64), (batch, 1))  # [B, T]
        return feeds

    def run(self, sess, plan: TokenPlan) -> list[dict[str, np.ndarray]]:
        step = graph_step(sess)                 # every output, by name
        ids, prompt = plan.ids, plan.prompt
        if not self.past:                       # no cache input: recompute the growing prefix
            return [step(self._feeds(ids[:, :end], 0)) for end in range(prompt, ids.shape[1] + 1)]
        results = []
        batch = ids.shape[0]
        # [B, H, 0, D]: empty for the prefill; [B, H, W, D] for a window-sized cache (sliding_window_caches)
        past = {t.name: np.zeros((batch, t.shape[1], self.windows.get(t.name, 0), t.shape[3]),
                                 np_dtype(t.dtype) if t.dtype in CACHE_DTYPES else np.float32) for t in self.past}
        start = 0
        for end in [prompt] + list(range(prompt + 1, ids.shape[1] + 1)):
            feeds = {**self._feeds(ids[:, start:end], start), **past}
            if self.merged:
                feeds["use_cache_branch"] = np.array([start > 0])
            outs = step(feeds)
            past = {t.name: outs[t.name.replace("past_key_values.", "present.")] for t in self.past}
            results.append({n: self.window_view(n, x, end) for n, x in outs.items()})
            start = end
        return results

    def window_view(self, name: str, present: np.ndarray, tokens: int) -> np.ndarray:
        """Output `name` of a step that has seen `tokens` tokens, as compared: for a present in
        compared_windows (W), the last min(tokens, W) positions, in order, [B, H, min(tokens, W), D].

        A window-sized cache holds those positions from slot 0 (sliding_window_caches), a growing one
        holds every position: the view is what both hold, so a graph with a sliding-window cache
        (GenAI's builder) compares with one that keeps the whole cache and masks the window (ours).
        Positions older than the window are read by neither graph's attention in that layer."""
        window = self.compared_windows.get(name)
        if window is None:
            return present
        past = name.replace("present.", "past_key_values.", 1)
        held = min(tokens, present.shape[2]) if past in self.windows else tokens    # valid slots, oldest first
        return np.ascontiguousarray(present[:, :, max(0, held - window):held])


def _hf_style(where, ins: tuple[TensorSpec, ...], outs: tuple[TensorSpec, ...], vocab_size: int | None,
              windows: dict[str, int] | None = None):
    """HuggingFaceStyle, or ContractError naming what does not fit."""
    by_in, by_out = {t.name: t for t in ins}, {t.name: t for t in outs}
    found = f"found inputs {sorted(by_in)[:8]}, outputs {sorted(by_out)[:8]}"
    extra_in = [n for n in by_in if n not in HF_TOKENS and n != "use_cache_branch" and not PAST.match(n)]
    extra_out = [n for n in by_out if n != "logits" and not PRESENT.match(n)]
    if "input_ids" not in by_in or "logits" not in by_out or extra_in or extra_out:
        raise ContractError(f"{where}: unknown decoder I/O convention: {found}; {KNOWN}")
    for n in HF_TOKENS:
        if n in by_in and by_in[n].dtype != "int64":
            raise ContractError(f"{where}: expected {n} of type int64, found {by_in[n]}; {KNOWN}")
    past = {PAST.match(n).groups() for n in by_in if PAST.match(n)}
    present = {PRESENT.match(n).groups() for n in by_out if PRESENT.match(n)}
    if past and past != present:
        raise ContractError(f"{where}: expected one present.N.key|value output per past_key_values.N.key|value "
                            f"input, {found}; {KNOWN}")
    for n in by_in:
        t = by_in[n]
        if PAST.match(n) and (len(t.shape) != 4 or t.shape[1] is None or t.shape[3] is None):
            raise ContractError(f"{where}: expected {n} of shape [batch, heads, past, head_dim] with static heads "
                                f"and head_dim (or a GroupQueryAttention that shows them), found {t}")
    if vocab_size is None:
        raise ContractError(f"{where}: expected logits [batch, seq, vocab] with a static vocabulary axis (or an "
                            f"embedding Gather of input_ids), found {by_out['logits']}")
    return HuggingFaceStyle(ins, outs, vocab_size, windows)


def _vocab_size(proto, logits: TensorSpec) -> int | None:
    """The static vocab axis of logits, else the row count of the embedding table input_ids indexes."""
    if logits.shape and logits.shape[-1] is not None:
        return logits.shape[-1]
    inits = {t.name: list(t.dims) for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == "input_ids" \
                and len(inits.get(node.input[0], [])) == 2:
            return inits[node.input[0]][0]
    return None


def _constant_ints(proto, name: str, producers: dict, inits: dict) -> list[int] | None:
    """The int64 values of an initializer or a Constant node's output, else None."""
    from onnx import AttributeProto, numpy_helper
    if name in inits:
        return [int(v) for v in numpy_helper.to_array(inits[name]).reshape(-1)]
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        for attr in node.attribute:            # value (a tensor) or value_ints
            if attr.type == AttributeProto.TENSOR:
                return [int(v) for v in numpy_helper.to_array(attr.t).reshape(-1)]
            if attr.type == AttributeProto.INTS:
                return list(attr.ints)
    return None


# ops whose output has the width of their first input (elementwise, norms, casts): followed back
_SAME_WIDTH = {"Add", "Sub", "Mul", "Div", "Cast", "Identity", "SimplifiedLayerNormalization", "LayerNormalization",
               "RotaryEmbedding", "Neg", "Relu", "Sigmoid", "Tanh"}


def _last_dim(proto, name: str, producers: dict, inits: dict, depth: int = 0) -> int | None:
    """The static size of the last axis of tensor `name`, read from the ops that make it: a
    projection (MatMul / Gemm by a constant weight, MatMulNBits' N), a Split's sizes, a Reshape to a
    constant shape, or the ops in _SAME_WIDTH followed back; None where the graph does not show it."""
    if name in inits:
        return list(inits[name].dims)[-1] if inits[name].dims else None
    node = producers.get(name)
    if node is None or depth > 16:
        return None
    attrs = {a.name: a for a in node.attribute}
    op = node.op_type
    if op == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
        return int(inits[node.input[1]].dims[1])
    if op == "Gemm" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
        return int(inits[node.input[1]].dims[0 if "transB" in attrs and attrs["transB"].i else 1])
    if op == "MatMulNBits" and "N" in attrs:
        return int(attrs["N"].i)
    if op == "Split" and ("axis" in attrs and attrs["axis"].i == -1):
        sizes = (_constant_ints(proto, node.input[1], producers, inits) if len(node.input) > 1 and node.input[1]
                 else list(attrs["split"].ints) if "split" in attrs else None)
        return sizes[list(node.output).index(name)] if sizes and len(sizes) == len(node.output) else None
    if op == "Reshape":
        shape = _constant_ints(proto, node.input[1], producers, inits)
        if shape and shape[-1] > 0:
            return shape[-1]
        if shape and shape[-1] == 0:
            return _last_dim(proto, node.input[0], producers, inits, depth + 1)
        return None
    if op in _SAME_WIDTH and node.input:
        return _last_dim(proto, node.input[0], producers, inits, depth + 1)
    return None


def _gqa_readers(proto):
    """(GroupQueryAttention node, its integer attributes) for every one that reads a past input."""
    for node in proto.graph.node:
        if node.op_type == "GroupQueryAttention" and len(node.input) >= 5:
            yield node, {a.name: a.i for a in node.attribute if a.type == 2}     # AttributeProto.INT


def _with_head_dims(proto, specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """Past and present specs with a symbolic head_dim filled in from the attention op that reads
    and writes them.

    ONNX Runtime GenAI declares past_key_values.N as [batch, H, past, 'kv_cache_dim'];
    its GroupQueryAttention(query, key, value, past_key, past_value, ...) reads them, with
    attributes num_heads / kv_num_heads. The head size is the width of its value input over
    kv_num_heads (Qwen3's and Gemma 3's graphs: a Split of the packed QKV projection, keys and
    queries through their QK-norms and Reshapes), or, when key and value are empty, of its packed
    query over num_heads + 2 kv_num_heads (a MatMul by a [hidden, (H + 2 H_kv) * D] weight, or an
    int4 MatMulNBits with N = that width); _last_dim reads the widths.
    """
    inits = {t.name: t for t in proto.graph.initializer}
    producers = {o: n for n in proto.graph.node for o in n.output}
    head_dim = {}
    for node, attrs in _gqa_readers(proto):
        kv_heads, heads = attrs.get("kv_num_heads", 0), attrs.get("num_heads", 0)
        if node.input[2]:
            width, count = _last_dim(proto, node.input[2], producers, inits), kv_heads
        else:
            width, count = _last_dim(proto, node.input[0], producers, inits), heads + 2 * kv_heads
        if width and count and width % count == 0:
            for cache in (*node.input[3:5], *node.output[1:3]):      # past key / value, present key / value
                head_dim[cache] = width // count
    return tuple(TensorSpec(t.name, t.dtype, t.shape[:3] + (head_dim[t.name],))
                 if (PAST.match(t.name) or PRESENT.match(t.name)) and len(t.shape) == 4 and t.shape[3] is None and t.name in head_dim else t
                 for t in specs)


def sliding_window_caches(proto) -> dict[str, int]:
    """{past input name: window} for every cache kept window-sized rather than growing.

    ONNX Runtime GenAI's builder writes a sliding-window layer (Gemma 2, Gemma 3) with
    GroupQueryAttention(..., local_window_size=W, sliding_window_cache=1) and declares its cache
    [batch, H, 'past_sliding_length', D]: the past is a buffer of at least W slots from the first
    step on (ONNX Runtime refuses an empty one: "KV cache capacity (0) must be at least
    local_window_size"), and the present the same buffer holding the last min(tokens, W) positions
    in order from slot 0 (seen on 0.18 with ONNX Runtime 1.32: once full, it shifts by one a step).
    GenAI's runtime feeds W slots (genai_config's sliding_window.window_size, cache_slack 0)."""
    out = {}
    for node, attrs in _gqa_readers(proto):
        if attrs.get("sliding_window_cache", 0) and attrs.get("local_window_size", -1) > 0:
            out[node.input[3]] = out[node.input[4]] = int(attrs["local_window_size"])
    return out


def prefills_from_slot_zero(proto) -> bool:
    """Whether a batched prefill (batch > 1, seq > 1) must start at slot 0: ONNX Runtime's
    GroupQueryAttention (graph_passes/ort_attention.py) takes a prompt that continues a
    cached one only at batch 1. The int8-cache graph keeps its GroupQueryAttention inside If branches
    (graph_passes/ort_attention.py, with_fp32_first_prompt)."""
    from graph_passes.base import all_nodes          # when called: graph_passes loads onnx_graphsurgeon
    return any(n.op_type == "GroupQueryAttention" for n in all_nodes(proto.graph))


def detect(proto, where: str = "graph"):
    """Ours or HuggingFaceStyle for a ModelProto; ContractError (one line) for anything else."""
    ins, outs = onnx_io(proto)
    names = set(ins)
    if POSITION in names or any(n.startswith(CACHE_PREFIX) for n in names):
        return Ours(read_contract(where, ins, outs), prefills_from_slot_zero(proto))   # or one clear line of what is off
    spec_in, spec_out = _with_head_dims(proto, tensor_specs(ins)), _with_head_dims(proto, tensor_specs(outs))
    logits = next((t for t in spec_out if t.name == "logits"), None)
    vocab = _vocab_size(proto, logits) if logits is not None else None
    return _hf_style(where, spec_in, spec_out, vocab, sliding_window_caches(proto))


def compare_windows(convs) -> None:
    """Make every Hugging Face style convention of graphs compared together view a present as the
    window that any of them keeps window-sized (the smallest W where several do): HuggingFaceStyle.window_view."""
    shared: dict[str, int] = {}
    for c in convs:
        for past, w in getattr(c, "windows", {}).items():
            present = past.replace("past_key_values.", "present.", 1)
            shared[present] = min(w, shared.get(present, w))
    for c in convs:
        if isinstance(c, HuggingFaceStyle):
            c.compared_windows = dict(shared)
