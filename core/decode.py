"""The one driver of the decode-step contract (core/contract.py): prefill, one-token steps,
the caches fed back, greedy generation and top-1 agreement, over a step function

    step(feeds: {input_ids [B, T], position [B], key_i / value_i}) -> {logits [B, T, V], present_key_i, ...}

    graph_step(sess)           an onnxruntime.InferenceSession (export.verify, the quantize check,
                               bench's plain ONNX Runtime loop): every output returned, the presents
                               fed back as the next step's caches
    InPlaceStep(sess, ...)     the same session with its caches bound in place (IO binding): the logits
                               returned, the caches read from step.caches; for real capacities, where
                               graph_step's presents are whole new caches every step
    DecoderSession.step        a runtime session (runtime/session.py): it keeps its caches in place,
                               so the driver feeds tokens and positions only (owns_caches=True)

    d = DecodeDriver(graph_step(sess), contract, batch=1)
    logits = d.prefill(ids)                 # ids [B, T] at slot 0 -> [B, T, V]
    logits = d.decode(tok, pos)             # tok [B], pos [B]       -> [B, V]

Numpy only, and torch-free, so export (below runtime) drives graphs with it too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.contract import INPUT_IDS, LOGITS, POSITION, DecodeContract, present_name


@dataclass
class Step:
    input_ids: np.ndarray    # int64 [B, T]
    position: np.ndarray     # int64 [B]


def graph_step(sess):
    """A step function over anything with ONNX Runtime's run(names, feeds) / get_outputs():
    every output of the graph, by name."""
    names = [o.name for o in sess.get_outputs()]

    def step(feeds: dict) -> dict:
        return dict(zip(names, sess.run(names, feeds)))
    return step


class InPlaceStep:
    """A step over an onnxruntime.InferenceSession on the CPU whose caches stay in place: each cache one zeroed
    array of ours, bound with IO binding as both key_i and present_key_i, so the graph writes the slots of the
    step into it (TensorScatter and GroupQueryAttention run in place when past and present share a buffer, as
    runtime.ort_session binds them). A step returns the logits only; `caches` holds the arrays by cache name.
    Drive it with DecodeDriver(step, contract, batch, owns_caches=True).

    Why: graph_step feeds the caches and gets the presents back as new arrays, so every step allocates, faults
    in and copies the whole capacity (Qwen3-0.6B's fp32 caches at 8448 slots: 1.9 GB a step)."""

    def __init__(self, sess, contract: DecodeContract, batch: int):
        self.sess, self.binding = sess, sess.io_binding()
        self.binding.bind_output(LOGITS, "cpu")             # bound first: get_outputs()[0]; ONNX Runtime sizes it
        self.caches = {n: np.zeros(contract.cache_shape(batch), contract.np_dtype) for n in contract.cache_names()}
        for name, cache in self.caches.items():
            for bind, bound in ((self.binding.bind_input, name), (self.binding.bind_output, present_name(name))):
                bind(bound, "cpu", 0, cache.dtype, list(cache.shape), cache.ctypes.data)

    def __call__(self, feeds: dict) -> dict:
        ids, pos = (np.ascontiguousarray(feeds[n], np.int64) for n in (INPUT_IDS, POSITION))
        self.binding.bind_cpu_input(INPUT_IDS, ids)
        self.binding.bind_cpu_input(POSITION, pos)
        self.binding.bind_output(LOGITS, "cpu")     # a new array each step: no returned logits are overwritten later
        self.sess.run_with_iobinding(self.binding)
        return {LOGITS: self.binding.get_outputs()[0].numpy()}


class DecodeDriver:
    """Drives one step function over the contract for `batch` sequences.

    A graph step is stateless: the driver holds the caches ([B, H, S_max, D] zeros at first)
    and feeds each step's presents back. A session that owns its caches (owns_caches=True)
    writes them in place; the driver then feeds only input_ids and position.
    """

    def __init__(self, step, contract: DecodeContract, batch: int, owns_caches: bool = False):
        self.step, self.contract, self.owns_caches = step, contract, owns_caches
        self.caches = {} if owns_caches else {
            n: np.zeros(contract.cache_shape(batch), contract.np_dtype) for n in contract.cache_names()}

    def run(self, input_ids: np.ndarray, position: np.ndarray) -> dict:
        """One step: every output of it; the caches it wrote become the next step's."""
        outs = self.step({INPUT_IDS: input_ids, POSITION: position, **self.caches})
        if not self.owns_caches:
            self.caches = {n: outs[present_name(n)] for n in self.contract.cache_names()}
        return outs

    def prefill(self, input_ids, position=None) -> np.ndarray:
        """input_ids [B, T] written at position (default slot 0) -> logits [B, T, V]."""
        ids = np.asarray(input_ids, np.int64)
        pos = np.zeros(ids.shape[0], np.int64) if position is None else np.asarray(position, np.int64)
        return self.run(ids, pos)[LOGITS]

    def decode(self, tokens, position) -> np.ndarray:
        """tokens [B] written at position [B] -> next-token logits [B, V]."""
        return self.run(np.asarray(tokens, np.int64)[:, None], np.asarray(position, np.int64))[LOGITS][:, -1]


def token_steps(ids: np.ndarray, prompt: int, start: np.ndarray | None = None) -> list[Step]:
    """ids [B, T] as a planned session: the first `prompt` tokens prefilled at slot start [B]
    (default 0), then the rest one token a step."""
    start = np.zeros(ids.shape[0], np.int64) if start is None else start
    return [Step(ids[:, :prompt], start.copy())] + [Step(ids[:, t:t + 1], start + t)
                                                    for t in range(prompt, ids.shape[1])]


def run_steps(step, contract: DecodeContract, steps: list[Step]) -> list[dict]:
    """Every output of every step of a planned session (prefill, then one-token steps). To keep only the logits
    and the last step's caches cut to the slots written (what a real-size verification can hold:
    models/layerwise.py), run_steps_in_place."""
    driver = DecodeDriver(step, contract, steps[0].input_ids.shape[0])
    return [driver.run(s.input_ids, s.position) for s in steps]


def run_steps_in_place(sess, contract: DecodeContract, steps: list[Step], trim: int) -> list[dict]:
    """A planned session on an ONNX Runtime session with the caches kept in place (InPlaceStep): the logits of
    every step and the last step's caches cut to their first `trim` slots, without a copy of the whole caches
    per step."""
    step = InPlaceStep(sess, contract, steps[0].input_ids.shape[0])
    driver = DecodeDriver(step, contract, steps[0].input_ids.shape[0], owns_caches=True)
    results = [driver.run(s.input_ids, s.position) for s in steps]
    results[-1].update({present_name(n): c[:, :, :trim].copy() for n, c in step.caches.items()})
    return results


def greedy_tokens(driver: DecodeDriver, prompts, steps: int) -> np.ndarray:
    """Prefill prompts [B, T] at slot 0, then `steps` greedy one-token steps -> tokens [B, steps + 1]."""
    b, t = np.shape(prompts)
    out = [driver.prefill(prompts)[:, -1].argmax(-1)]
    for k in range(steps):
        out.append(driver.decode(out[-1], np.full(b, t + k, np.int64)).argmax(-1))
    return np.stack(out, 1)


def greedy(step, contract: DecodeContract, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` (batch 1): prefill at slot 0, then one-token steps."""
    if n < 1:
        return []
    return greedy_tokens(DecodeDriver(step, contract, 1), [prompt], n - 1)[0].tolist()


def prefill_logits(step, contract: DecodeContract, tokens: list[int]) -> np.ndarray:
    """logits [T, V] of one prefill over `tokens` (batch 1, slot 0)."""
    return DecodeDriver(step, contract, 1).prefill([tokens])[0]


def greedy_top1_agreement(ref_step, step, contract: DecodeContract, prompt: list[int], n: int) -> tuple[float, int]:
    """Top-1 agreement over the reference's own greedy continuation: the reference generates n greedy tokens
    after `prompt`; both then read prompt + those tokens (teacher-forced, so one early miss does not derail
    the rest) and the share of the n positions where their next-token argmax agrees is returned, with n (cut
    to what the cache holds). (export.reference_check.teacher_forced_top1 is the build's, over given text.)"""
    n = max(1, min(n, contract.capacity - len(prompt)))
    new = greedy(ref_step, contract, prompt, n)
    seq = prompt + new[:-1]
    window = slice(len(prompt) - 1, len(seq))                    # the positions that predicted `new`
    ref = prefill_logits(ref_step, contract, seq).argmax(-1)[window]
    got = prefill_logits(step, contract, seq).argmax(-1)[window]
    return float(np.mean(ref == got)), int(len(ref))
