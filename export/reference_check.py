"""The build's verification: the written graph against the torch reference of the checkpoint itself.

    the torch reference, block by block (models/layerwise.py) ─▶ the graph in ONNX Runtime ─▶ compare
                                                                  (export/verify.py's tolerances)

Prefill + decode steps on random and real tokens; every logit, and the cache slots the steps wrote, with
the tolerance of the graph's dtype (export/verify.py); fp32 also allows what torch's own fp32 rounding is
on those inputs when the fixed tolerance is exceeded (a float64 reference, run only then). A quantized
graph is checked against the folded model holding the graph's own dequantized weights (GraphWeights:
what is left is how MatMulNBits computes), and its drift and teacher-forced top-1 agreement against the
float model are reported (a trained model's top-1 below export.quantize.MIN_TOP1 fails the build).
Only one model is alive at a time: the reference holds one block, then is gone before ONNX Runtime loads
the graph. Into the report's verification, quantized.drift / .tolerance and eps_approximation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from core.heap import release_freed_memory
from export.options import tolerance_key
from export.report import BuildReport, QuantDrift, QuantTolerance, Stages

REAL_TEXT = ("Once upon a time there was a little girl named Lily. She loved to play in the garden "
             "with her red ball, and one day she saw a big dog under the tall tree.")


def real_tokens(tokenizer: Path | None, vocab_size: int) -> list[int] | None:
    """REAL_TEXT by the model's tokenizer.json, ids inside the vocabulary (None: no tokenizer, or
    nothing usable): the verification's real-text session."""
    if tokenizer is None:
        return None
    from models.checkpoint import load_tokenizer
    return [i for i in load_tokenizer(Path(tokenizer).parent).encode(REAL_TEXT).ids if i < vocab_size] or None


def checkable(path: Path, report: BuildReport, log) -> Path:
    """The graph ONNX Runtime's CPU can run: itself, or for bf16 its widened copy (export/bfloat16.py)."""
    from core.contract import contract_of
    if contract_of(path).dtype != "bf16":
        return path
    from export.bfloat16 import widened_copy
    line = (f"{path.name} is bf16, which ONNX Runtime's CPU kernels do not compute: verified as its widened "
            "copy (the same graph and bf16 weights, each weight cast to fp32 where it is read; activations "
            "in fp32) against the fp32 torch reference; bf16 arithmetic itself runs in bench/gpu_check.sh")
    report.notes.append(line)
    if log is not None:
        log(f"      note: {line}")
    return widened_copy(path)


def teacher_forced_top1(ref_runs, runs) -> tuple[float, int]:
    """Share of positions (every step, every sequence) where both runs' argmax agree, both runs having read
    the same tokens (teacher-forced; core.decode.greedy_top1_agreement is the greedy measure), and how many."""
    same = total = 0
    for rs, gs in zip(ref_runs, runs):
        for r, g in zip(rs, gs):
            a, b = r["logits"].argmax(-1), g["logits"].argmax(-1)
            same += int((a == b).sum())
            total += a.size
    return same / max(total, 1), total


def quantized_drift(float_runs, runs, agree: float, n: int, prompt: str) -> QuantDrift:
    """The quantized graph's logits against the float model's, and the teacher-forced top-1 agreement (`agree`
    over `n` positions of `prompt`)."""
    from export.quantize import logits_diff
    worst_logits, mean_logits, ref_scale = logits_diff(float_runs, runs)
    return QuantDrift(worst_logits, mean_logits, ref_scale, agree, n, prompt)


def verify_graph(source, path: Path, report: BuildReport, stages: Stages, dtype: str, quantize,
                 tokens: list[int] | None, same_start: bool, trained: bool = True,
                 also: list | None = None, meanwhile=None) -> list[dict] | None:
    """The written graph against the torch reference, block by block (see the module doc); into
    report.verification.graph_vs_torch (and report.quantized's drift and tolerance for a quantized graph).
    `also`: a session (Steps) the fp32 reference runs beside its own (the transformers check's): its outputs,
    or None when the reference computes in another dtype (an fp16 graph's) or there is none. `meanwhile`: called
    as ONNX Runtime's check starts, for work beside it (the transformers check's imports: ONNX Runtime leaves
    the GIL free while it computes)."""
    from core.contract import contract_of
    from export.conventions import run_onnx, verification_sessions
    from export.verify import VerificationError, compare_sessions, ort_session
    from models.decoder import TORCH_DTYPES
    from models.layerwise import layerwise_run, used_slots
    log = stages.log
    checked = checkable(path, report, log)
    iface = contract_of(checked)
    sessions = verification_sessions(iface, tokens, same_start=same_start)
    steps = [s for _, s in sessions]
    # the reference computes in the graph's dtype; a bf16 graph is checked widened, so against fp32
    torch_dtype = TORCH_DTYPES["fp32" if dtype == "bf16" else dtype]
    extra = [also] if also is not None and torch_dtype == TORCH_DTYPES["fp32"] else []
    beside = "; the transformers check's session beside them" if extra else ""
    t0 = stages.start(f"torch reference, block by block ({len(sessions)} sessions: prefill + decode steps{beside}"
                      f"{'; and with the graph dequantized weights' if quantize is not None else ''})")
    agreement = agreement_steps(tokens, iface) if quantize is not None else []
    runs_ref = layerwise_run(source, steps + agreement + extra, torch_dtype, log=log)
    n, a = len(steps), len(agreement)
    runs_ref, agreement_ref, extra_ref = runs_ref[:n], runs_ref[n:n + a], runs_ref[n + a:]
    runs_deq = None
    if quantize is not None and quantize.algo == "rtn":
        from export.quant_reference import GraphWeights
        if log is not None:
            log("      and with the graph's dequantized weights:")
        runs_deq = layerwise_run(source, steps, parts=GraphWeights(source, checked), log=log)
    stages.done("reference", t0)
    release_freed_memory()
    t0 = stages.start(f"verify {path.name} in ONNX Runtime vs the torch reference"
                      f"{' with its dequantized weights; drift and top-1 vs the float model' if quantize else ''}")
    if meanwhile is not None:
        meanwhile()
    sess = ort_session(checked, threads=0)        # every core: the 128-token agreement prompt is most of the stage
    runs = [run_onnx(sess, iface, s, trim=used_slots(s)) for s in steps]
    agreement_runs = [run_onnx(sess, iface, s, trim=used_slots(s)) for s in agreement]
    del sess
    exact = runs_deq is not None                      # against its own dequantized weights
    refs = runs_deq if exact else runs_ref
    key = tolerance_key(dtype, iface.dtype, quantize)
    what = f"{path.name} vs torch{' with its dequantized weights' if exact else ''}"
    try:
        results = compare_sessions(sessions, refs, runs, key, what)
    except VerificationError:
        if key != "fp32":
            raise
        # fp32 past the fixed tolerance: allow what torch's own fp32 rounding is on these inputs (float64 reference)
        exact64 = layerwise_run(source, steps, __import__("torch").float64)
        results = compare_sessions(sessions, refs, runs, key, what,
                                   slacks=[rounding_slack_of(r, e) for r, e in zip(refs, exact64)])
        report.notes.append("fp32: compared with torch's own fp32 rounding as slack (a float64 reference was run)")
    report.verification.graph_vs_torch = {c.what: c.max_abs_diff for c in results}
    stages.done("verify", t0, f": max |d logits| {report.verification.worst('logits'):.3g}")
    if quantize is not None:
        text = agreement_ref or runs_ref, agreement_runs or runs       # real text when there is some
        _quantized_quality(report, quantize, runs_ref, runs, text, exact, trained, path.name, log)
    if checked != path:
        checked.unlink()                # our own temporary graph (the weights are the build's)
    return extra_ref[0] if extra_ref else None


def rounding_slack_of(ref: list[dict], exact: list[dict]) -> dict[str, float]:
    """Per output, FP32_ROUNDING_SLACK x max |reference fp32 - reference float64| over a session's steps: what
    rounding alone can move that output by on these inputs (export/verify.py)."""
    from export.verify import FP32_ROUNDING_SLACK
    out: dict[str, float] = {}
    for r32, r64 in zip(ref, exact):
        for name, value in r32.items():
            diff = float(np.nanmax(np.abs(value.astype(np.float64) - r64[name]))) if value.size else 0.0
            out[name] = max(out.get(name, 0.0), FP32_ROUNDING_SLACK * diff)
    return out


def agreement_steps(tokens: list[int] | None, iface) -> list:
    """The session the top-1 agreement of a quantized graph is taken over: one prefill of real text
    (AGREEMENT_TOKENS positions, the text repeated to fill them) from slot 0; none without text."""
    from core.decode import Step
    from export.quantize import AGREEMENT_TOKENS
    if not tokens:
        return []
    n = max(1, min(AGREEMENT_TOKENS, iface.capacity))
    ids = np.resize(np.asarray(tokens, np.int64) % iface.vocab_size, n)[None]         # [1, n]
    return [[Step(ids, np.zeros(1, np.int64))]]


def _quantized_quality(report: BuildReport, quantize, runs_ref, runs, text, exact: bool, trained: bool, name: str,
                       log) -> None:
    """Drift (on the verification sessions) and top-1 agreement (on `text`: the real-text session's float and
    quantized runs, else the verification sessions) against the float model; below MIN_TOP1 a graph that
    could not be checked against its own dequantized weights fails when the model is trained."""
    from export.quantize import MIN_TOP1
    from export.verify import ATOL, SCALE_TOL, VerificationError
    agree, n = teacher_forced_top1(*text)
    what = "real text" if text[0] is not runs_ref else "the verification sessions"
    report.quantized.drift = quantized_drift(runs_ref, runs, agree, n, f"{what}, teacher-forced, vs the float model")
    key = tolerance_key("fp32", "fp32", quantize)
    report.quantized.tolerance = QuantTolerance(ATOL[key], SCALE_TOL[key], MIN_TOP1[quantize.dtype],
                                                "dequantized weights" if exact else "float model")
    if agree >= MIN_TOP1[quantize.dtype]:
        return
    line = (f"top-1 agreement with the float model {agree:.1%} over {n} positions < {MIN_TOP1[quantize.dtype]:.0%} "
            f"(the {quantize.dtype} floor of a trained model); try --head int8, --block-size 16, --algo hqq, or int8")
    if trained and not exact:
        raise VerificationError(f"{name} vs torch", [line])
    why = "" if trained else " (random weights: reported, not enforced)"
    report.notes.append(line + why)     # the graph is exact (checked above); its quality is the model's and the dtype's
    if log is not None:
        log(f"      note: {line}{why}")


def eps_approximation(source, path: Path, tokens, same_start: bool):      # -> models.disabled_norm.EpsApproximation
    """Disabled norms (eps >= 1e6, LN-free GPT-2): the eps approximation error on the verification tokens
    (models/disabled_norm.py, the model whole: such models are GPT-2 sized); None without any."""
    import copy
    import torch
    from core.contract import contract_of
    from export.conventions import verification_sessions
    from models.checkpoint import DISABLED_NORM_EPS
    from models.disabled_norm import approximation_error
    cfg = source.cfg
    if not any(cfg.eps_of(n) >= DISABLED_NORM_EPS for n in cfg.norm_names()):
        return None
    model = source.fill(copy.deepcopy(source.skeleton), "").eval()
    for rotary in model.rotaries().values():       # non-persistent buffers: to_empty left them unset
        rotary.reset_parameters()
    sessions = verification_sessions(contract_of(path), tokens, same_start=same_start)
    batches = [torch.from_numpy(np.concatenate([s.input_ids for s in steps], axis=1)) for _, steps in sessions]
    return approximation_error(model, batches)
