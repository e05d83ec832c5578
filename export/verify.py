"""Export validation: run torch and ONNX Runtime (or two ONNX graphs) on the same
decode session and compare every output.

A session is a prefill of a few tokens followed by several one-token decode
steps, the present caches of each step fed back as the next step's past. The
graphs may follow our contract (core/contract.py, export/emit.py), Optimum's / ONNX Runtime
GenAI's (past_key_values.N -> present.N, merged or not, with or without past) or
return logits only: export/conventions.py detects which and drives it. Every
output of every step is compared; each failure is collected and one
VerificationError lists them all:

    export verification failed (model.fused.onnx vs torch):
    - random tokens, seed 0: logits: max abs diff 0.003 > atol 0.0001
    - real tokens: present_key_1: max abs diff ...

    python -m export.verify A.onnx B.onnx [--reference R.onnx]   # exit 0: same outputs; 1: not (or bad input); 2: bad usage

ONNX Runtime runs with graph optimizations off (ORT_DISABLE_ALL), so what is
compared is the graph as written, not what ORT's own fusions make of it.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort

from core.build_files import TOKENIZER
from core.contract import check_external_data_file, contract_of, load_onnx
from core.errors import ArgumentParser, UserError, first_line, float_in
from core.lifecycle import run_cli
from export.conventions import (Step, compare_windows, detect, interface_mismatches, run_onnx,  # noqa: F401
                                session_steps)

# Per-dtype absolute tolerances. fp32: the fold only reorders a per-channel
# product (x*s)@W vs x@(sW), a few ulp per MatMul; 1e-4 on logits leaves room for
# depth while catching any real error (a wrong scale moves logits by >1e-2).
# fp16 has a 2^-11 relative step, so a fixed absolute bound cannot fit every
# logit magnitude (trained All-Taper logits reach ~30, where one ulp is 0.016):
# fp16 allows ATOL_FP16 plus SCALE_TOL_FP16 (about 8 ulps) times the largest
# |reference| value of that output, for 10-20 fp16 MatMuls accumulated in a
# different order by torch and ORT. fp32 adds SCALE_TOL_FP32, about 16 ulps (2^-23 each) of the
# largest |reference| value: below it for every model whose outputs stay O(30), but a norm-free model
# fed random tokens drives its activations far from the training distribution (the zoo's All-Taper
# Gemma 3 reaches logits of 4438 there, Qwen3's 180), where summation order alone moves a logit by
# 1e-4 .. 1e-3 (seen: 2.4e-4 at 180, 1.3e-6 of it).
ATOL_FP32 = 1e-4
SCALE_TOL_FP32 = 2e-6
ATOL_FP16 = 1e-2
SCALE_TOL_FP16 = 4e-3
# Weight-only quantized graphs (export/quantize.py: int8 / int4 weights, fp32 activations)
# against the fp32 graph they came from. Rounding every weight to 255 (int8) or 15 (int4)
# levels per block of 32 moves outputs by a share of their scale, not by ulps: measured on
# the 1M zoo models, logits moved by up to ~1.5% (int8) and ~11% (int4) of max |logits|,
# the caches by ~0.6% and ~7% of max |cache|. Deeper models drift further: the bench's 124M
# (12 layers, random init, int4 with int8 activations) moved its logits by 33% and its deepest
# caches by 40% of max |reference| (bench-i13 drift_by_size, 2026-11-30). The bounds (atol 1e-2
# plus 5% / 50% of the largest |reference| value of that output) leave room for that and still
# catch a wrong block layout, axis or scale, which moves outputs by about their whole scale or
# more (scales x 3: ~200%, tests/export/test_quantize.py).
ATOL_QUANT = 1e-2
SCALE_TOL_INT8 = 0.05
SCALE_TOL_INT4 = 0.50
# A quantized graph against the torch model holding its own dequantized weights (the streamed
# build, export/quant_reference.py): what is left is how MatMulNBits computes (int8 activations
# at accuracy level 4, summation order). That rounding accumulates with depth: measured up to 2.6 %
# of max |reference| on a 2-layer Llama and 4.0 % on the Llama-3.2-1B shape (16 layers, random init,
# int4, deepest caches). 15 % leaves room for 64-layer models; a wrong block layout, axis, scale or
# table moves outputs by about their whole scale or more, which stays far outside.
ATOL_DEQUANTIZED = 1e-2
SCALE_TOL_DEQUANTIZED = 0.15
DEQUANTIZED = "dequantized"
# bf16 graphs, checked widened (export/bfloat16.py: bf16 weights, fp32 arithmetic) against the fp32
# reference: what is left is every folded weight rounded to bf16's 8 significant bits (a relative
# step of 2^-8, ~0.4 %), summed over each dot product and the layers. Like fp16's, the bound is
# ATOL_BF16 plus a share of the largest |reference| value: SCALE_TOL_BF16 is 8 bf16 steps (~3 %);
# measured: see docs/export.md "Half precision". A wrong weight, fold or cast moves outputs by
# about their whole scale.
ATOL_BF16 = 1e-2
SCALE_TOL_BF16 = 8 * 2.0 ** -8
ATOL = {"fp32": ATOL_FP32, "fp16": ATOL_FP16, "bf16": ATOL_BF16, "int8": ATOL_QUANT, "int4": ATOL_QUANT,
        DEQUANTIZED: ATOL_DEQUANTIZED}
SCALE_TOL = {"fp32": SCALE_TOL_FP32, "fp16": SCALE_TOL_FP16, "bf16": SCALE_TOL_BF16, "int8": SCALE_TOL_INT8,
             "int4": SCALE_TOL_INT4, DEQUANTIZED: SCALE_TOL_DEQUANTIZED}


class VerificationError(UserError):
    """Outputs that disagree beyond tolerance; `mismatches` holds one line per output."""

    def __init__(self, what: str, mismatches: list[str]):
        self.what, self.mismatches = what, mismatches
        # no details: str() below already lists the mismatches, and the CLI would print them twice
        super().__init__(f"export verification failed ({what}): {len(mismatches)} mismatch(es)")

    def __str__(self) -> str:
        return f"export verification failed ({self.what}):\n" + "\n".join(f"- {m}" for m in self.mismatches)


read_interface = contract_of     # the decode-step contract of one graph (a ModelProto: where "graph"), from its I/O


def ort_session(path_or_proto, optimize: bool = False, threads: int = 1) -> ort.InferenceSession:
    """A CPU session for the checks (threads 0: every core)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    # ONNX Runtime's DEFAULT order may run every node whose inputs are ready first: a widened bf16
    # graph's weight Casts (export/bfloat16.py) then all ran before the first MatMul, holding every
    # weight in fp32 at once (the Llama-3.2-1B shape: 6.1 GB against 3.9 GB in PRIORITY_BASED order,
    # which runs each Cast beside its reader). The order does not change any op's numbers.
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # and no arena or memory pattern: they keep the high-water mark of every shape a check feeds
    # (prefill and decode steps), 1 GB more on that graph (5.5 -> 4.5 GB); a check runs a few steps
    opts.enable_cpu_mem_arena = False
    opts.enable_mem_pattern = False
    if not isinstance(path_or_proto, onnx.ModelProto):
        check_external_data_file(path_or_proto)
    src = path_or_proto.SerializeToString() if isinstance(path_or_proto, onnx.ModelProto) else str(path_or_proto)
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


# A graph may round no further from the exact (float64) result than FP32_ROUNDING_SLACK times what
# torch's own fp32 forward does on the same inputs: on a well-conditioned model that term is ~1e-6 and
# the fixed tolerances above decide; a norm-free model driven out of its training distribution (random
# tokens) amplifies rounding through its layers, which no fixed tolerance can tell from an error. The
# zoo's All-Taper Gemma 3 on random tokens: logits up to 4630, torch fp32 0.007-0.018 from float64,
# ONNX Runtime (its own MatMul blocking and Gelu) up to 0.29 from torch, i.e. 16 x torch's deviation.
FP32_ROUNDING_SLACK = 32.0


@dataclass
class Comparison:
    what: str
    max_abs_diff: dict[str, float] = field(default_factory=dict)   # per output, max over steps
    atol: float = ATOL_FP32
    tolerance: dict[str, float] = field(default_factory=dict)   # per output: atol (+ scale term for fp16)

    @property
    def worst(self) -> float:
        return max(self.max_abs_diff.values(), default=0.0)


def _max_abs_diffs(r: dict, g: dict, names: list[str]) -> dict[str, float]:
    """Max |r - g| per output for one step, computed as Polygraphy's SimpleCompareFunc does (fp16 widened to
    fp32, 8- and 16-bit integers to int32, then |a - b| in that dtype) without its other statistics, which cost
    seconds a build on a real vocabulary; inf where either side holds a NaN or an inf (there |a - b| is NaN or
    inf too: matching infinities are no match)."""
    out = {}
    for n in names:
        a, b = _widened(np.asarray(r[n])), _widened(np.asarray(g[n]))
        if a.size == 0:
            out[n] = 0.0
            continue
        finite = a.dtype.kind in "iu" or bool(np.isfinite(a).all() and np.isfinite(b).all())
        out[n] = float(np.abs(a - b).max()) if finite else float("inf")
    return out


def _widened(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if a.dtype.kind in "iu" and a.dtype.itemsize <= 2:
        return a.astype(np.int32)
    if a.dtype == np.uint32:
        return a.astype(np.int64)
    if a.dtype == np.bool_:
        return a.astype(np.int8)
    return a


def compare(ref: list[dict], got: list[dict], dtype: str, what: str, atol: float | None = None,
            slack: dict[str, float] | None = None) -> Comparison:
    """Per-output max |ref - got| over all steps; raises one VerificationError listing every mismatch.
    `slack`: per output, what rounding alone may add (rounding_slack), on top of the dtype's tolerance.

    Names and shapes are checked here; values step by step (_max_abs_diffs).
    """
    scale_tol = SCALE_TOL[dtype] if atol is None else 0.0
    atol = ATOL[dtype] if atol is None else atol
    cmp, problems = Comparison(what, atol=atol), []
    ref_max: dict[str, float] = {}
    if len(ref) != len(got):
        raise VerificationError(what, [f"{len(ref)} steps vs {len(got)} steps"])
    for s, (r, g) in enumerate(zip(ref, got)):
        names = []
        for name in r:
            if name not in g:
                problems.append(f"{name}: missing from the second run's outputs (step {s})")
            elif np.shape(r[name]) != np.shape(g[name]):
                problems.append(f"{name}: shape {list(np.shape(g[name]))}, expected {list(np.shape(r[name]))} (step {s})")
            else:
                names.append(name)
        problems += [f"{name}: unexpected extra output (step {s})" for name in g if name not in r]
        for name, diff in _max_abs_diffs(r, g, names).items():
            cmp.max_abs_diff[name] = max(cmp.max_abs_diff.get(name, 0.0), diff)
            finite = np.abs(np.asarray(r[name], np.float64))
            finite = finite[np.isfinite(finite)]
            ref_max[name] = max(ref_max.get(name, 0.0), float(finite.max()) if finite.size else 0.0)
    for name, diff in cmp.max_abs_diff.items():
        extra = (slack or {}).get(name, 0.0)
        tol = atol + scale_tol * ref_max.get(name, 0.0) + extra
        cmp.tolerance[name] = tol
        if not diff <= tol:
            bound = f"atol {atol:g}" if scale_tol == 0 and not extra else \
                f"tolerance {tol:.3g} (atol {atol:g} + {scale_tol:g} x max |ref| {ref_max[name]:.3g}" + \
                (f" + {FP32_ROUNDING_SLACK:g} x torch's own fp32 rounding {extra / FP32_ROUNDING_SLACK:.3g})" if extra else ")")
            problems.append(f"{name}: max abs diff {diff:.3g} > {bound}")
    if problems:
        raise VerificationError(what, sorted(set(problems), key=problems.index))
    return cmp


def verify_pair(a, b, atol: float | None = None, seeds=(0, 1), tokens=None, reference=None) -> list[Comparison]:
    """Compare two graphs (paths or ModelProtos) of the same I/O convention on the same sessions.

    With `reference` (a third graph, e.g. the unfused export), A and B are each
    compared against it as well. Every graph runs with ORT optimizations off.
    """
    graphs = [(a, "first graph"), (b, "second graph")] + ([(reference, "reference")] if reference is not None else [])
    protos = [p if isinstance(p, onnx.ModelProto) else onnx.load(str(p)) for p, _ in graphs]
    labels = [label for _, label in graphs]
    conv = [detect(p, label) for p, label in zip(protos, labels)]
    bad = []
    for c, label in zip(conv[1:], labels[1:]):
        if type(c) is not type(conv[0]) or c.name != conv[0].name:
            bad.append(f"{label} is {c.describe()}, the first graph {conv[0].describe()}")
        else:
            bad += [f"{label}: {m}" if label == "reference" else m for m in conv[0].mismatches(c)]
    if bad:
        raise VerificationError("interfaces", bad)
    if any(getattr(c, "same_start", False) for c in conv):    # one graph's limit holds for every graph's steps
        conv[0].same_start = True
    compare_windows(conv)       # a layer's sliding-window cache in one graph: its last W positions in every graph
    sessions = conv[0].sessions(seeds, tokens)
    outs = [_run_all(c, p, label, sessions) for c, p, label in zip(conv, protos, labels)]
    dtype = tolerance_key(*protos, float_dtype=conv[0].dtype if conv[0].dtype in ATOL else "fp32")
    pairs = [("second graph vs first", 0, 1)]
    if reference is not None:
        pairs += [("first graph vs reference", 2, 0), ("second graph vs reference", 2, 1)]
    results, problems = [], []
    for what, r, g in pairs:
        prefix = f"{what}: " if reference is not None else ""
        try:
            results += compare_sessions(sessions, outs[r], outs[g], dtype, what, atol, prefix)
        except VerificationError as e:
            problems += e.mismatches
    if problems:
        raise VerificationError(", ".join(what for what, _, _ in pairs), problems)
    return results


def _run_all(conv, proto, label: str, sessions) -> list[list[dict]]:
    """Every session's outputs of one graph; ONNX Runtime refusing the graph or its inputs is one line."""
    state = ort.capi.onnxruntime_pybind11_state
    try:
        sess = ort_session(proto)
        return [conv.run(sess, plan) for _, plan in sessions]
    except (state.Fail, state.InvalidArgument, state.RuntimeException, state.InvalidGraph, state.NotImplemented) as e:
        raise UserError(f"{label}: ONNX Runtime could not run it as {conv.describe()} (prefill + one-token steps, "
                        f"batch 2): {first_line(e)}; check that it runs on the CPU provider with these inputs") from None


def tolerance_key(*protos, float_dtype: str | None = None) -> str:
    """The ATOL / SCALE_TOL entry for comparing these graphs: the weight dtype of a quantized
    one (export/quantize.py metadata), else the graphs' float dtype (float_dtype, or read
    from the first graph's decode contract)."""
    from export.quantize import quantized_config
    for p in protos:
        q = quantized_config(p)
        if q is not None:
            return q.dtype
    return float_dtype if float_dtype is not None else read_interface(protos[0]).dtype


def compare_sessions(sessions, refs, runs, dtype: str, what: str, atol: float | None = None,
                     prefix: str = "", slacks: list[dict] | None = None) -> list[Comparison]:
    """compare() of each labelled session [(label, steps)]'s reference and run, labels after `prefix`
    (`slacks`: each session's rounding_slack); ONE VerificationError lists the mismatches of all."""
    results, problems = [], []
    slacks = slacks or [None] * len(sessions)
    for label, ref, got, slack in ((prefix + label, ref, got, slack) for (label, _), ref, got, slack
                                   in zip(sessions, refs, runs, slacks)):
        try:
            results.append(compare(ref, got, dtype, label, atol, slack))
        except VerificationError as e:
            problems += [f"{label}: {m}" for m in e.mismatches]
    if problems:
        raise VerificationError(what, problems)
    return results


def run(argv: list[str]) -> int:
    ap = ArgumentParser(prog="python -m export.verify",
                        description="Compare two exported decoder graphs of the same I/O convention (ours, "
                                    "Optimum / ORT GenAI with or without past, merged or not, logits-only) on prefill "
                                    "+ decode sessions (exit 0 equal; 1 not equal, or bad input with an error: line).")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--atol", type=float_in(0.0), default=None,
                    help="absolute tolerance >= 0 (default: per dtype, fp32 1e-4; a weight-quantized graph "
                         "(model.int8/int4.onnx) gets its dtype's bound, relative to the outputs' scale)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json (or a build directory holding one): also compare on real text")
    ap.add_argument("--text", default="Once upon a time there was a little cat named Tom. He liked to play.",
                    help="the text tokenized for --tokenizer")
    ap.add_argument("--reference", default=None,
                    help="a third graph (e.g. the unfused export) run with ORT optimizations off: A and B are each "
                         "also compared against it")
    args = ap.parse_args(argv)
    tokens = None
    if args.tokenizer:
        from pathlib import Path
        from core.inputs import check_text
        from tokenizers import Tokenizer
        tok_path = Path(args.tokenizer)
        tok_path = tok_path / TOKENIZER if tok_path.is_dir() else tok_path
        try:
            tokens = Tokenizer.from_file(str(tok_path)).encode(check_text(args.text, "--text")).ids
        except UserError:
            raise
        except Exception as e:  # tokenizers raises a bare Exception
            raise UserError(f"{tok_path}: expected a readable tokenizer.json, found an error ({first_line(e)}); "
                            "pass the model's tokenizer.json") from None
    pa, pb = load_onnx(args.a), load_onnx(args.b)
    pr = load_onnx(args.reference) if args.reference else None
    conv = detect(pa, args.a)
    detect(pb, args.b)
    if pr is not None:
        detect(pr, args.reference)
    print(f"convention: {conv.describe()}")
    try:
        results = verify_pair(pa, pb, args.atol, tokens=tokens, reference=pr)
    except VerificationError as e:
        print(str(e))
        print(f"NOT EQUAL: {args.a} vs {args.b}")
        return 1
    for c in results:
        print(f"{c.what}: {len(c.max_abs_diff)} output(s), max abs diff {c.worst:.3g}, "
              f"logits {c.max_abs_diff.get('logits', 0):.3g} <= tolerance {c.tolerance.get('logits', c.atol):.3g}")
    print(f"EQUAL: {args.a} vs {args.b}")
    return 0


def main(argv=None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
