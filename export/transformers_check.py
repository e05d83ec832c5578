"""A Hugging Face folder's build checks our torch model against transformers' own forward of the same folder,
so that the build is checked against an outside reference and not only against our own reading of the config
(issue 42: a lost rope base passed graph_vs_torch). Into the report's transformers_vs_ours (TransformersCheck).

Our side is the torch reference the graph was verified against (models/layerwise.py, block by block): the
build hands the check session (transformers_steps) to its fp32 reference run, so our model is never filled
whole for it; a caller without those logits (an fp16 build, the tests) gets them from a layerwise run here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from core.inputs import human_bytes
from export.memory import transformers_check_bytes
from export.options import BuildError


@dataclass
class TransformersCheck:
    """The check's figures (report.json's transformers_vs_ours), or why it was skipped."""
    skipped: str = ""                   # why it did not run ("" when it ran)
    logits_max_abs_diff: float = 0.0
    max_abs_ref: float = 0.0            # max |transformers' logits|
    prefill_tokens: int = 0
    cached_steps: int = 0
    atol: float = 0.0
    scale_tol: float = 0.0
    transformers: str = ""              # its version
    rounding_slack: float = 0.0         # past the fixed tolerance: transformers' own fp32 rounding (x FP32_ROUNDING_SLACK)

    def to_json(self) -> dict:
        if self.skipped:
            return {"skipped": self.skipped}
        out = {"logits_max_abs_diff": self.logits_max_abs_diff, "max_abs_ref": self.max_abs_ref,
               "prefill_tokens": self.prefill_tokens, "cached_steps": self.cached_steps, "atol": self.atol,
               "scale_tol": self.scale_tol, "transformers": self.transformers}
        if self.rounding_slack:
            out["rounding_slack"] = self.rounding_slack
        return out

    def line(self) -> str:
        """The report's line of the check."""
        if self.skipped:
            return f"transformers_vs_ours skipped: {self.skipped}"
        slack = f" + rounding slack {self.rounding_slack:.3g}" if self.rounding_slack else ""
        return (f"transformers_vs_ours max |d logits| {self.logits_max_abs_diff:.3g} (prefill {self.prefill_tokens} "
                f"tokens + {self.cached_steps} cached steps; atol {self.atol:g} + {self.scale_tol:g} x max|ref| "
                f"{self.max_abs_ref:.3g}{slack}; transformers {self.transformers})")


TRANSFORMERS_TOKENS, TRANSFORMERS_STEPS = 12, 4     # the transformers check: a prefill, then cached one-token steps


def _transformers_skip(cfg) -> str | None:
    """Why the transformers check cannot run here (None: it can)."""
    from core.inputs import available_memory      # looked up when called: tests replace it
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install transformers to compare with it)"
    need, avail = transformers_check_bytes(cfg), available_memory()
    if avail is not None and need > avail:
        return (f"transformers' model (fp32, and float64 past the fixed tolerance) needs ~{human_bytes(need)}, this "
                f"machine has {human_bytes(avail)} available")
    return None


def transformers_steps(source, tokens: list[int] | None):       # -> list[core.decode.Step] | None
    """The check's session for our torch reference (a prefill from slot 0, then TRANSFORMERS_STEPS one-token
    steps, batch 1): None for a folder that is not a Hugging Face one (nothing to check)."""
    if not source.source.startswith("hf:"):
        return None
    from core.decode import token_steps
    ids, prefill = _check_ids(source.cfg, tokens)
    return token_steps(ids[None], prefill)


class TransformersImports:
    """transformers and the folder's model class, imported in a background thread while the build's ONNX Runtime
    check runs (it leaves the GIL free while it computes): the 2-3 s of imports the transformers check would
    begin with (transformers, its model code, torch._dynamo) are done by the time it starts. On the Llama-3.2-1B
    shape's build: the check 7.3 -> 4.7 s, the ONNX Runtime stage unchanged. `start` once, `wait` before the
    check imports anything. A failure is the check's to report: it imports the same modules again."""

    def __init__(self, source):
        import importlib.util
        import threading
        self.model_type = source.source[3:]     # ("hf:<model_type>")
        wanted = source.source.startswith("hf:") and importlib.util.find_spec("transformers") is not None
        self._thread = threading.Thread(target=self._import, name="transformers-imports",
                                        daemon=True) if wanted else None    # daemon: an interrupt does not wait

    def _import(self) -> None:
        # modules only: the folder's config is parsed by the check itself, where transformers' warnings are quieted
        import importlib
        try:
            from transformers import AutoModelForCausalLM  # noqa: F401
            from transformers.models.auto.configuration_auto import model_type_to_module_name
            module = model_type_to_module_name(self.model_type)
            importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except Exception:       # noqa: BLE001 - reported by the check itself, which imports these again
            pass

    def start(self) -> None:
        if self._thread is not None and self._thread.ident is None:     # (ident: None until started)
            self._thread.start()

    def wait(self) -> None:
        """Until the imports are done (at once when they never started): never two threads importing one module."""
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join()


def _check_ids(cfg, tokens: list[int] | None) -> tuple[np.ndarray, int]:
    """The check's token ids [total] (real text repeated, else seeded random ids) and its prefill length."""
    total = min(TRANSFORMERS_TOKENS, cfg.max_seq_len)
    steps = min(TRANSFORMERS_STEPS, total - 1)
    ids = np.resize(np.asarray(tokens, np.int64), total) if tokens else \
        np.random.default_rng(0).integers(0, cfg.vocab_size, total)
    return ids % cfg.vocab_size, total - steps


def transformers_check(source, report, log, tokens: list[int] | None, ours: list[dict] | None = None,
                       imports: TransformersImports | None = None) -> None:
    """A Hugging Face folder: our torch model (the reference graph_vs_torch checked the graph against) against
    transformers' own forward of the same folder, so that the build is checked against an outside reference and
    not only against our own reading of the config (issue 42: a lost rope base passed graph_vs_torch). A prefill,
    then TRANSFORMERS_STEPS one-token steps through each side's KV cache, real text when there is some; the fp32
    tolerance of export/verify.py whatever the graph's dtype (both sides run in fp32). Skipped, saying why, when
    transformers is missing or the two models would not fit in memory at once (transformers_check_bytes) or it
    cannot load the folder; a mismatch fails the build (BuildError, one line). `ours`: our reference's outputs of
    transformers_steps (models.layerwise.layerwise_run in fp32; None: run here). `imports`: the build's background
    imports, waited for first. Into `report` (an export.report.BuildReport): its transformers_vs_ours and
    timings_s["transformers"]."""
    if imports is not None:
        imports.wait()
    if not source.source.startswith("hf:"):
        return
    from export.verify import ATOL, SCALE_TOL
    cfg = source.cfg
    skip = _transformers_skip(cfg)
    if skip is None:
        t0 = time.perf_counter()
        try:
            found = _transformers_vs_ours(source, tokens, lambda scale: ATOL["fp32"] + SCALE_TOL["fp32"] * scale, ours)
        except _TransformersCannot as e:
            skip = str(e)
        else:
            report.timings_s["transformers"] = round(time.perf_counter() - t0, 3)
    if skip is not None:
        report.transformers_vs_ours = TransformersCheck(skipped=skip)
        if log is not None:
            log(f"      transformers_vs_ours skipped: {skip}")
        return
    diff, scale, prefill, steps, slack = found
    tol = ATOL["fp32"] + SCALE_TOL["fp32"] * scale + slack
    report.transformers_vs_ours = TransformersCheck(
        "", diff, scale, prefill, steps, ATOL["fp32"], SCALE_TOL["fp32"], __import__("transformers").__version__, slack)
    if log is not None:
        log(f"      {report.transformers_vs_ours.line()}")
    if not diff <= tol:     # (NaN too)
        extra = f" + rounding slack {slack:.3g}" if slack else ""
        raise BuildError(f"{source.where}: transformers_vs_ours: expected the converted model's logits within {tol:.3g} "
                         f"of transformers' own (atol {ATOL['fp32']:g} + {SCALE_TOL['fp32']:g} x max|ref| {scale:.3g}"
                         f"{extra}; prefill {prefill} tokens + {steps} cached steps), found max |d| {diff:.3g}; the converter "
                         "reads this config.json otherwise than transformers does: nothing was written, report it "
                         "with the folder's config.json")


class _TransformersCannot(Exception):
    """transformers cannot load or run the folder (its version, its own checks): the check is skipped."""


def _transformers_vs_ours(source, tokens: list[int] | None, tolerance,
                          ours: list[dict] | None = None) -> tuple[float, float, int, int, float]:
    """(max |d logits|, max |transformers' logits|, prefill tokens, cached steps, rounding slack) of the check.
    `ours`: our reference's outputs of transformers_steps (None: a layerwise fp32 run of them here).
    Past `tolerance(max |transformers' logits|)`, transformers runs again in float64 (its model converted in
    place): the slack is FP32_ROUNDING_SLACK times its own fp32 rounding on these tokens, as the build's
    verification allows (export/verify.py)."""
    import contextlib
    import io
    import warnings

    import torch
    from core.errors import first_line
    ids, prefill = _check_ids(source.cfg, tokens)
    if ours is None:
        from models.layerwise import layerwise_run
        ours = layerwise_run(source, [transformers_steps(source, tokens)], torch.float32)[0]
    got = torch.from_numpy(np.concatenate([step["logits"] for step in ours], axis=1)).double()     # [1, total, V]
    ids = torch.from_numpy(ids).long()[None]                                                       # [1, total]
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    quiet = contextlib.redirect_stderr(io.StringIO())
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with quiet, warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            try:
                hf = AutoModelForCausalLM.from_pretrained(source.where, dtype=torch.float32).eval()
            except Exception as e:      # its version or its own checks: not ours to judge
                raise _TransformersCannot(f"transformers cannot load {source.where} ({first_line(e)[:200]})") from None
            want = transformers_cached_logits(hf, ids, prefill).double()
            diff, scale, slack = float((got - want).abs().max()), float(want.abs().max()), 0.0
            if not diff <= tolerance(scale):
                from export.verify import FP32_ROUNDING_SLACK
                slack = FP32_ROUNDING_SLACK * float((want - transformers_cached_logits(hf.double(), ids, prefill)).abs().max())
    finally:
        hf_logging.set_verbosity(level)
    return diff, scale, prefill, ids.shape[1] - prefill, slack


def transformers_cached_logits(hf, ids, prefill: int):
    """transformers' logits [B, T, V]: a prefill, then one token a call over its own cache (the build's
    transformers_vs_ours check and the tests that compare with transformers)."""
    import torch
    out = hf(ids[:, :prefill], use_cache=True)
    ref, past = [out.logits], out.past_key_values
    for t in range(prefill, ids.shape[1]):
        out = hf(ids[:, t:t + 1], past_key_values=past, use_cache=True)
        ref.append(out.logits)
        past = out.past_key_values
    return torch.cat(ref, 1)
