"""export.build --kv-cache int8: a written GroupQueryAttention graph's caches made int8, calibrated and checked.

    cache = int8_cache(graph_path, tokenizer, log)    # the graph file rewritten in place (its weights untouched):
                                                      # export.build calls it inside its temporary output folder
    cache.drift, cache.agreement                   # against the same graph with its fp32 cache

ONNX Runtime's int8 cache needs static scales per key/value head and channel
(graph_passes/ort_attention.py, with_int8_cache). They are calibrated on the graph the build
wrote and verified (fp32 cache), then checked like every other transformation, by running the
model before and after on the same inputs:

  1. calibrate: the fp32-cache graph prefills the first half of the check text; the scales are
     the largest |key| and |value| its caches hold per channel (int8_scales);
  2. before: the fp32-cache graph prefills the whole check text (its second half unseen by the
     calibration), then CHECK_STEPS greedy steps: their logits and tokens;
  3. the graph file is rewritten with int8 caches (the proto only: the weights' file is as written;
     a failed check leaves the build's temporary folder, never a finished build, with it); a first
     prompt attends in fp32 and quantizes what it writes (with_fp32_first_prompt: ONNX Runtime's
     int8 kernel is slow on prompts), so the check's prefill logits are the fp32 cache's;
  4. after: the int8-cache graph runs the same tokens, teacher-forced on the fp32 cache's greedy
     text, and its own greedy steps. The build fails when the logits move further than
     KV_CACHE_DRIFT["int8"] of max |logits|; the share of greedy tokens both choose is reported.

The check text is CHECK_TEXT in the model's tokenizer (seeded random ids without one, as Int8Cache.text says).
One session at a time: the graph is never held twice.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from export.options import BuildError

CHECK_STEPS = 32           # greedy steps after the check text, compared before and after
RANDOM_TOKENS = 256        # the check text's length without a tokenizer
# Varied English (narrative, instructions, figures, a little code) so that the calibration sees keys and values
# of more than one kind of text; about 300 tokens in a byte-level BPE.
CHECK_TEXT = (
    "The harbour was quiet when Mara pulled the boat onto the shingle. Gulls argued over a crate of fish, "
    "and somewhere up the hill a radio was playing an old song about leaving. She checked the tide table "
    "again: low water at 14:32, a range of 4.7 metres, wind from the south-west at 12 knots.\n\n"
    "To reset the router, hold the button on the back for ten seconds, wait until the light turns amber, "
    "then connect to the network named in the label. If nothing happens after two minutes, unplug it, "
    "count to thirty and try again.\n\n"
    "Q: What is the capital of Australia? A: Canberra, not Sydney, although Sydney is the largest city. "
    "The population was about 26.6 million in 2023; most people live near the coast.\n\n"
    "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n\n"
    "In 1905 Einstein published four papers: on the photoelectric effect, Brownian motion, special "
    "relativity and the equivalence of mass and energy, E = mc^2. Each changed physics.\n\n"
    "Dear Sam, thank you for the book! I read it on the train and missed my stop twice. Let's meet on "
    "Friday at the café near the station; I'll bring the maps. Best wishes, Jo.")


@dataclass
class Int8Cache:
    """What the int8 cache check found (report.json's "kv_cache_check")."""
    text: str                  # "CHECK_TEXT (n tokens)" or "random ids (n)"
    calibration_tokens: int
    steps: int
    drift: float               # max |logits int8 - fp32 cache| / max |logits fp32 cache|, prefill and steps
    bound: float               # KV_CACHE_DRIFT["int8"]
    agreement: float           # share of the CHECK_STEPS + 1 greedy tokens both caches choose
    first_difference: int | None   # the first greedy step where they part (None: never)
    kept_fp32: bool = False    # --kv-cache auto: it drifted past the bound, and the graph kept its fp32 cache

    def line(self) -> str:
        parted = "" if self.first_difference is None else f", first parting at step {self.first_difference}"
        kept = "; past the bound, so the fp32 cache was kept" if self.kept_fp32 else ""
        return (f"int8 KV cache vs fp32 cache max |d logits| {self.drift:.2%} of max |logits| (bound "
                f"{self.bound:.0%}) over {self.text} + {self.steps} greedy steps; greedy agreement "
                f"{self.agreement:.0%}{parted}; scales from the first {self.calibration_tokens} tokens{kept}")

    def to_json(self) -> dict:
        return {**asdict(self), "summary": self.line()}


def check_tokens(tokenizer: Path | None, vocab_size: int, capacity: int) -> tuple[list[int], str]:
    """The check text's ids (CHECK_TEXT by the tokenizer, else seeded random ids), cut to leave the greedy steps
    room in the cache; and how to name it."""
    ids = None
    if tokenizer is not None:
        from models.checkpoint import load_tokenizer
        ids = [i for i in load_tokenizer(Path(tokenizer).parent).encode(CHECK_TEXT).ids if i < vocab_size] or None
    room = capacity - CHECK_STEPS - 1
    if ids is None:
        ids = np.random.default_rng(0).integers(0, vocab_size, min(RANDOM_TOKENS, room)).tolist()
        return ids, f"random ids ({len(ids)})"
    ids = ids[:room]
    return ids, f"CHECK_TEXT ({len(ids)} tokens)"


def int8_cache(path: Path, tokenizer: Path | None, log=None, keep_fp32: bool = False) -> Int8Cache:
    """Calibrate, rewrite and check (module docstring) the fp32-cache GroupQueryAttention graph at `path`, in
    place. When the int8 cache moves the logits past its bound: BuildError, or with keep_fp32 (--kv-cache auto)
    the graph file as it was (fp32 cache) and the result saying so (kept_fp32)."""
    import onnx
    from core.contract import contract_of
    from core.onnx_writer import save_onnx
    from core.outputs import sign_onnx
    from graph_passes.ort_attention import (KV_CACHE_DRIFT, int8_scales, rotated_key_caches, with_fp32_first_prompt,
                                           with_int8_cache)
    contract = contract_of(path)
    if contract.capacity < CHECK_STEPS + 3:
        raise BuildError(f"--kv-cache int8: expected a capacity of at least {CHECK_STEPS + 3} tokens to calibrate "
                         f"and check the cache, found {contract.capacity}; raise --max-seq-len")
    ids, text = check_tokens(tokenizer, contract.vocab_size, contract.capacity)
    calibration = max(1, len(ids) // 2)
    proto = onnx.load(str(path), load_external_data=False)
    fp32_graph = path.read_bytes() if keep_fp32 else None      # the file as written: put back on a failed check
    rotated = rotated_key_caches(proto)
    with _session(path) as sess:
        calibrating = _driver(sess, contract)
        calibrating.prefill([ids[:calibration]])
        scales = {n: int8_scales(c[:, :, :calibration], n in rotated) for n, c in calibrating.step.caches.items()}
        del calibrating                            # its caches: one capacity's worth held at a time
        before, tokens = _run(_driver(sess, contract), ids, None)
    sign_onnx(with_fp32_first_prompt(with_int8_cache(proto, scales)))
    save_onnx(proto, path)        # the proto only: its weights stay in the file they were written to
    contract = contract_of(path)                                        # its caches now int8
    with _session(path) as sess:
        forced, _ = _run(_driver(sess, contract), ids, tokens)
        _, own = _run(_driver(sess, contract), ids, None)
    drift = max(float(np.abs(a - b).max() / max(float(np.abs(a).max()), 1e-30)) for a, b in zip(before, forced))
    same = np.asarray(tokens) == np.asarray(own)
    result = Int8Cache(text, calibration, CHECK_STEPS, drift, KV_CACHE_DRIFT["int8"], float(same.mean()),
                       None if same.all() else int(np.argmin(same)))
    if drift > result.bound and keep_fp32:
        result.kept_fp32 = True
        path.write_bytes(fp32_graph)       # (in the build's temporary folder, as save_onnx wrote it above)
    if log is not None:
        log(f"      {result.line()}")
    if drift > result.bound and not keep_fp32:
        raise BuildError(f"--kv-cache int8: expected the int8 cache to keep the logits within {result.bound:.0%} of "
                         f"max |logits| of the fp32 cache's, found {drift:.2%} ({text}); build with --kv-cache fp16 "
                         "or fp32")
    return result


def _driver(sess, contract):
    """A batch-1 driver of the session over zeroed caches kept in place (core.decode.InPlaceStep: the check's steps
    do not copy the whole capacity each)."""
    from core.decode import DecodeDriver, InPlaceStep
    return DecodeDriver(InPlaceStep(sess, contract, 1), contract, 1, owns_caches=True)


def _run(driver, ids: list[int], forced: list[int] | None) -> tuple[list[np.ndarray], list[int]]:
    """Prefill `ids`, then CHECK_STEPS steps, each fed the previous greedy token (forced: those tokens instead):
    the last-position logits of every call [V] and the greedy tokens chosen."""
    logits = [driver.prefill([ids])[0, -1]]
    chosen = [int(logits[-1].argmax())]
    for k in range(CHECK_STEPS):
        fed = chosen[-1] if forced is None else forced[k]
        logits.append(driver.decode([fed], [len(ids) + k])[0])
        chosen.append(int(logits[-1].argmax()))
    return logits, chosen


@contextlib.contextmanager
def _session(path: Path):
    """An ONNX Runtime session on the graph file (every core), let go on exit: one graph held at a time."""
    from export.verify import ort_session
    sess = ort_session(path, optimize=True, threads=0)
    try:
        yield sess
    finally:
        del sess
