"""The decoder I/O conventions export.verify can drive, detected from a graph's inputs and outputs.

| convention | inputs | outputs | driven as |
|---|---|---|---|
| ours (core/contract.py) | input_ids, position, key_i / value_i [B, H, S_max, D] | logits, present_key_i / present_value_i | prefill, then one-token steps, caches fed back: core/decode.py |
| kv-cache (Optimum, ONNX Runtime GenAI) | input_ids, attention_mask, [position_ids], past_key_values.N.key / .value [B, H, P, D], [use_cache_branch] | logits, present.N.key / .value [B, H, P+T, D] | prefill with an empty past, then one-token steps, presents fed back |
| prefill-only (Optimum without past) | input_ids, [attention_mask], [position_ids] | logits, present.N.key / .value | the growing prefix, recomputed each step |
| logits-only | input_ids, [attention_mask], [position_ids] | logits | the growing prefix, recomputed each step |

A merged decoder (Optimum's If on use_cache_branch) is a kv-cache graph:
use_cache_branch is False for the prefill, True for the steps after it. Every
output of every step is returned, so every one is compared. `detect` raises one
line naming what it found and the conventions it knows.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from core.contract import (CACHE_DTYPES, CACHE_PREFIX, POSITION, ContractError, DecodeContract, TensorSpec, np_dtype,
                           onnx_io, read_contract, tensor_specs)
from core.decode import Step, graph_step, run_steps, token_steps

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
    """Outputs of every step of an ONNX Runtime session, driven by core.decode (see run_steps for `trim`)."""
    return run_steps(graph_step(sess), iface, steps, trim)


def interface_mismatches(a, b) -> list[str]:
    """How the inputs / outputs (TensorSpecs) of a and b differ: DecodeContracts or HuggingFaceStyles."""
    out = []
    for kind, xa, xb in (("input", a.inputs, b.inputs), ("output", a.outputs, b.outputs)):
        if [x.name for x in xa] != [x.name for x in xb]:
            out.append(f"{kind} names differ: {[x.name for x in xa]} vs {[x.name for x in xb]}")
            continue
        for ta, tb in zip(xa, xb):
            if ta != tb:
                out.append(f"{kind} {ta} vs {tb}")
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

    def __init__(self, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], vocab_size: int):
        self.inputs, self.outputs, self.vocab_size = inputs, outputs, vocab_size
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
            return f"Optimum/GenAI kv-cache ({n} layers{', merged with use_cache_branch' if self.merged else ''}, {self.dtype})"
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
        past = {t.name: np.zeros((batch, t.shape[1], 0, t.shape[3]),                # [B, H, 0, D]: empty for the prefill
                                 np_dtype(t.dtype) if t.dtype in CACHE_DTYPES else np.float32) for t in self.past}
        start = 0
        for end in [prompt] + list(range(prompt + 1, ids.shape[1] + 1)):
            feeds = {**self._feeds(ids[:, start:end], start), **past}
            if self.merged:
                feeds["use_cache_branch"] = np.array([start > 0])
            outs = step(feeds)
            results.append(outs)
            past = {t.name: outs[t.name.replace("past_key_values.", "present.")] for t in self.past}
            start = end
        return results


def _hf_style(where, ins: tuple[TensorSpec, ...], outs: tuple[TensorSpec, ...], vocab_size: int | None):
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
    return HuggingFaceStyle(ins, outs, vocab_size)


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


def _with_head_dims(proto, specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """Past specs with a symbolic head_dim filled in from the attention op that reads them.

    ONNX Runtime GenAI declares past_key_values.N as [batch, H, past, 'kv_cache_dim'];
    its GroupQueryAttention(query, key, value, past_key, past_value, ...) reads them, with
    attributes num_heads / kv_num_heads and, when key is empty, a packed QKV projection
    MatMul(x, W [hidden, (num_heads + 2 kv_num_heads) * head_dim]) as its query.
    """
    inits = {t.name: list(t.dims) for t in proto.graph.initializer}
    producers = {o: n for n in proto.graph.node for o in n.output}
    head_dim = {}
    for node in proto.graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 5:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        qkv = producers.get(node.input[0])
        if qkv is None or qkv.op_type != "MatMul" or len(inits.get(qkv.input[1], [])) != 2:
            continue
        width = inits[qkv.input[1]][1]
        heads = attrs.get("num_heads", 0) + (2 * attrs.get("kv_num_heads", 0) if not node.input[1] else 0)
        if heads and width % heads == 0:
            head_dim[node.input[3]] = head_dim[node.input[4]] = width // heads
    return tuple(TensorSpec(t.name, t.dtype, t.shape[:3] + (head_dim[t.name],))
                 if PAST.match(t.name) and len(t.shape) == 4 and t.shape[3] is None and t.name in head_dim else t
                 for t in specs)


def prefills_from_slot_zero(proto) -> bool:
    """Whether a batched prefill (batch > 1, seq > 1) must start at slot 0: ONNX Runtime's
    GroupQueryAttention (graph_passes/ort_attention.py) takes a prompt that continues a
    cached one only at batch 1."""
    return any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)


def detect(proto, where: str = "graph"):
    """Ours or HuggingFaceStyle for a ModelProto; ContractError (one line) for anything else."""
    ins, outs = onnx_io(proto)
    names = set(ins)
    if POSITION in names or any(n.startswith(CACHE_PREFIX) for n in names):
        return Ours(read_contract(where, ins, outs), prefills_from_slot_zero(proto))   # or one clear line of what is off
    spec_in, spec_out = _with_head_dims(proto, tensor_specs(ins)), tensor_specs(outs)
    logits = next((t for t in spec_out if t.name == "logits"), None)
    vocab = _vocab_size(proto, logits) if logits is not None else None
    return _hf_style(where, spec_in, spec_out, vocab)
