"""python -m export.build [--fuse] [--checkpoint DIR] [--out DIR] [--dtype fp32|fp16]

checkpoint ──export──▶ model.onnx ──verify vs torch──▶ [graph_passes ──▶ model.fused.onnx ──verify──▶] report.json

Writes into OUT (default build/<checkpoint name>/):
    model.onnx         the unfused export (TaperNorm at g=0 as Mul by a constant vector)
    model.fused.onnx   with --fuse: scales and norm gammas folded into the MatMul weights
    config.json        copied from the checkpoint
    tokenizer.json     copied from the checkpoint
    report.json        op counts before/after, folded layers, max diffs, timings (docs/export.md)

Everything is written into a temporary sibling directory that is renamed into
place at the end: an interrupted or failed build leaves OUT as it was. User
errors print one line `error: ...` on stderr and exit 1.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "zoo" / "internal-taper"
NORM_OPS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")
REAL_TEXT = ("Once upon a time there was a little girl named Lily. She loved to play in the garden "
             "with her red ball, and one day she saw a big dog under the tall tree.")


class BuildError(RuntimeError):
    """A build that cannot proceed; the message is one line (or a verification list) for the user."""


def _log(msg: str) -> None:
    print(msg, flush=True)


def op_counts(proto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in proto.graph.node).items()))


BUILD_MARKERS = ("report.json", "model.onnx")


def check_writable(out: Path, checkpoint: Path | None = None) -> None:
    """Fail before any work if OUT cannot be created or replaced.

    OUT is replaced as a whole, so an existing OUT must be empty or an earlier
    build (it holds report.json or model.onnx), and must not hold the checkpoint.
    """
    if out.exists() and not out.is_dir():
        raise BuildError(f"{out}: exists and is not a directory; choose another --out")
    if checkpoint is not None and checkpoint.exists():
        o, c = out.resolve(), checkpoint.resolve()
        if o == c or o in c.parents:
            raise BuildError(f"{out}: contains the checkpoint {checkpoint}, and the build replaces --out as a whole; "
                             "choose another --out")
    if out.is_dir() and any(out.iterdir()) and not any((out / m).exists() for m in BUILD_MARKERS):
        raise BuildError(f"{out}: exists, is not empty and is not an earlier build (no report.json or model.onnx); "
                         "the build replaces --out as a whole: choose a new or empty --out")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise BuildError(f"{out}: cannot be created ({parent} is not a directory); choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.parent.exists() and not os.access(out.parent, os.W_OK)):
        raise BuildError(f"{out}: not writable (no write permission on {parent}); choose another --out")


def check_model(model, fuse: bool, dtype: str) -> None:
    """Refuse, before anything is written, what the build cannot do."""
    from models.checkpoint import DISABLED_NORM_EPS
    cfg = model.cfg
    if fuse and cfg.norm == "taper" and model.gate.value != 0.0:
        names = ", ".join(model.taper_layers())
        raise BuildError(f"{names}: TaperNorm gate {model.gate.value:g}; --fuse needs gate 0 "
                         "(finish the taper, or build without --fuse)")
    if dtype == "fp16":
        disabled = [name or "model" for name, m in model.named_modules()
                    if isinstance(getattr(m, "eps", None), (int, float)) and m.eps >= DISABLED_NORM_EPS]
        if disabled:
            eps = max(m.eps for _, m in model.named_modules() if isinstance(getattr(m, "eps", None), (int, float)))
            raise BuildError(f"{', '.join(disabled)}: norm eps {eps:g} >= {DISABLED_NORM_EPS:g} is a disabled "
                             f"(FakeLN-style) norm and overflows fp16 (max 65504); build with --dtype fp32")


def _real_tokens(ckpt: Path, vocab: int) -> list[int] | None:
    from models.checkpoint import load_tokenizer
    ids = [i for i in load_tokenizer(ckpt).encode(REAL_TEXT).ids if i < vocab]
    return ids or None


class _Sessions:
    """The decode sessions of a build, with the torch reference and each graph's outputs computed once."""

    def __init__(self, model, proto, tokens, seeds=(0, 1)):
        from export.verify import read_interface, run_torch, session_steps
        self.iface = read_interface(proto)
        self.sessions = [(f"random tokens, seed {s}", session_steps(self.iface, seed=s)) for s in seeds]
        if tokens:
            self.sessions.append(("real tokens", session_steps(self.iface, tokens=tokens)))
        self.torch = [run_torch(model, self.iface, steps) for _, steps in self.sessions]

    def run(self, proto) -> list:
        from export.verify import ort_session, run_onnx
        sess = ort_session(proto)
        return [run_onnx(sess, self.iface, steps) for _, steps in self.sessions]

    def compare(self, ref_runs, runs, what: str) -> dict:
        """session label -> output -> max abs diff; raises VerificationError on any mismatch."""
        from export.verify import compare_sessions
        results = compare_sessions([(label, ref, got) for (label, _), ref, got in zip(self.sessions, ref_runs, runs)],
                                   self.iface.dtype, what)
        return {c.what: c.max_abs_diff for c in results}


def _norm_layers(proto) -> list[str]:
    """Layer names of the normalization ops left in a graph."""
    from graph_passes.base import PassContext
    ctx = PassContext(proto)
    return [ctx.layer_name(n) for n in ctx.graph.nodes if n.op in NORM_OPS]


def _leftover_taper(proto) -> list[str]:
    """TaperNorm nodes still in a fused graph (by torch provenance)."""
    from graph_passes.base import PassContext
    ctx = PassContext(proto)
    return sorted({ctx.layer_name(n) for n in ctx.graph.nodes
                   if any(c.endswith(".TaperNorm") for c in ctx.module_class(n))})


def build(checkpoint: Path, out: Path, fuse: bool, dtype: str = "fp32", log=_log) -> dict:
    """Run the whole build; returns the report (also written to OUT/report.json)."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    n_stages = 6 if fuse else 4

    def stage(i, msg):
        log(f"[{i}/{n_stages}] {msg}")

    def done(key, t0, extra=""):
        timings[key] = round(time.perf_counter() - t0, 3)
        log(f"      {timings[key]:.1f} s{extra}")

    check_writable(out, checkpoint)
    t0 = time.perf_counter()  # stage 1 is announced once loaded and checked: a refusal prints only its error line
    import logging
    import torch  # noqa: F401  (imported here: the error paths above stay fast)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    from models.checkpoint import CONFIG, TOKENIZER, load_checkpoint, replace_dir
    model = load_checkpoint(checkpoint)
    check_model(model, fuse, dtype)
    cfg = model.cfg
    tokens = _real_tokens(checkpoint, cfg.vocab_size)
    ref_model = model if dtype == "fp32" else copy.deepcopy(model).to(torch.float16)
    stage(1, f"load checkpoint {checkpoint}")
    done("load", t0, f": {cfg.norm}{' (' + cfg.taper_scope + ')' if cfg.taper_scope else ''}, "
         f"{model.num_params():,} params, gate {model.gate.value if cfg.norm == 'taper' else '-'}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        from export.onnx_export import export_onnx
        from export.verify import ATOL, SCALE_TOL
        stage(2, f"export {dtype} ONNX (opset 24, KV cache via TensorScatter)")
        t0 = time.perf_counter()
        proto = export_onnx(model, tmp / "model.onnx", dtype)
        counts = {"unfused": op_counts(proto)}
        norm_layers = {"unfused": _norm_layers(proto)}
        done("export", t0, f": {len(proto.graph.node)} nodes")

        stage(3, "verify model.onnx vs torch (prefill + 3 decode steps, random and real tokens)")
        t0 = time.perf_counter()
        sessions = _Sessions(ref_model, proto, tokens)
        unfused_runs = sessions.run(proto)
        diffs = {"unfused_vs_torch": sessions.compare(sessions.torch, unfused_runs, "model.onnx vs torch")}
        done("verify_unfused", t0, f": max |d logits| {_worst(diffs['unfused_vs_torch'], 'logits'):.3g}")

        folded, notes, lint = [], [], []
        if fuse:
            from graph_passes import DEFAULT_PASSES, PassError, run_passes
            from graph_passes.__main__ import save_atomic
            stage(4, f"fuse: {', '.join(DEFAULT_PASSES)}")
            t0 = time.perf_counter()
            try:
                fused, results = run_passes(proto, DEFAULT_PASSES)
            except PassError as e:
                raise BuildError(str(e)) from None
            for r in results:
                if r.name == "fold_constants":
                    notes += [f"fold_constants: {d}" for _, d in r.rewrites]
                    continue
                folded += [{"pass": r.name, "layer": l, "detail": d} for l, d in r.rewrites]
                notes += [n for n in r.notes if not n.startswith("trt: ")]
                lint += [n[len("trt: "):] for n in r.notes if n.startswith("trt: ")]
            leftover = _leftover_taper(fused)
            if leftover:
                why = "; ".join(notes) or "no matching pattern"
                raise BuildError(f"{', '.join(leftover)}: TaperNorm left unfolded ({why})")
            save_atomic(fused, tmp / "model.fused.onnx")
            counts["fused"] = op_counts(fused)
            norm_layers["fused"] = _norm_layers(fused)
            done("fuse", t0, f": {len(folded)} layer(s) folded, nodes {len(proto.graph.node)} -> {len(fused.graph.node)}")

            stage(5, "verify model.fused.onnx vs torch and vs model.onnx")
            t0 = time.perf_counter()
            from export.verify import interface_mismatches, read_interface, VerificationError
            bad = interface_mismatches(read_interface(proto), read_interface(fused))
            if bad:
                raise VerificationError("model.fused.onnx vs model.onnx interfaces", bad)
            fused_runs = sessions.run(fused)
            diffs["fused_vs_torch"] = sessions.compare(sessions.torch, fused_runs, "model.fused.onnx vs torch")
            diffs["fused_vs_unfused"] = sessions.compare(unfused_runs, fused_runs, "model.fused.onnx vs model.onnx")
            done("verify_fused", t0, f": max |d logits| vs torch {_worst(diffs['fused_vs_torch'], 'logits'):.3g}")

        stage(n_stages, f"write {out}")
        t0 = time.perf_counter()
        shutil.copyfile(checkpoint / CONFIG, tmp / CONFIG)
        shutil.copyfile(checkpoint / TOKENIZER, tmp / TOKENIZER)
        timings["total"] = round(time.perf_counter() - t_start, 3)
        report = {
            "checkpoint": str(checkpoint), "out": str(out), "dtype": dtype, "fuse": fuse,
            "model": {"norm": cfg.norm, "taper_scope": cfg.taper_scope,
                      "gate": model.gate.value if cfg.norm == "taper" else None,
                      "n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head,
                      "vocab_size": cfg.vocab_size, "capacity": cfg.max_seq_len,
                      "tie_embeddings": cfg.tie_embeddings, "params": model.num_params()},
            "files": sorted(p.name for p in tmp.iterdir()) + ["report.json"],
            "op_counts": counts,
            "norm_ops": {k: sum(v.get(op, 0) for op in NORM_OPS) for k, v in counts.items()},
            "norm_layers": norm_layers,
            "folded": folded, "notes": notes, "trt_lint": lint,
            "atol": ATOL[dtype], "scale_tol": SCALE_TOL[dtype], "max_abs_diff": diffs, "timings_s": timings,
            "versions": _versions(),
        }
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    timings["write"] = round(time.perf_counter() - t0, 3)
    log(f"      {timings['write']:.1f} s")
    _summary(report, log)
    return report


def _worst(per_session: dict, name: str | None = None) -> float:
    vals = [v for d in per_session.values() for k, v in d.items() if name is None or k == name]
    return max(vals, default=0.0)


def _versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def _summary(r: dict, log) -> None:
    m = r["model"]
    log(f"built {r['out']} in {r['timings_s']['total']:.1f} s: {m['norm']}"
        f"{' (' + m['taper_scope'] + ')' if m['taper_scope'] else ''}, {r['dtype']}")
    for kind, counts in r["op_counts"].items():
        names = r["norm_layers"][kind]
        shown = f" ({', '.join(names)})" if 0 < len(names) <= 3 else ""
        log(f"  {kind:8s} {sum(counts.values())} nodes, {r['norm_ops'][kind]} norm op(s){shown}, "
            f"{counts.get('MatMul', 0)} MatMul, {counts.get('Mul', 0)} Mul, {counts.get('Add', 0)} Add")
    if r["fuse"]:
        by_pass = Counter(f["pass"] for f in r["folded"])
        log(f"  folded   {len(r['folded'])} layer(s): " + ", ".join(f"{p} {n}" for p, n in by_pass.items()))
    for key, per in r["max_abs_diff"].items():
        log(f"  {key:17s} max |d logits| {_worst(per, 'logits'):.3g}, all outputs {_worst(per):.3g} (atol {r['atol']:g}" + (f" + {r['scale_tol']:g} x max|ref|" if r["scale_tol"] else "") + ")")
    if r["trt_lint"]:
        log(f"  trt_lint {len(r['trt_lint'])} issue(s): {r['trt_lint'][0]}" + (" ..." if len(r["trt_lint"]) > 1 else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.build", description="Export, fuse and verify a checkpoint.")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                    help="checkpoint directory (default: the bundled models/zoo/internal-taper)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: build/<checkpoint name>/)")
    ap.add_argument("--fuse", action="store_true", help="also fold norms/scales into weights (model.fused.onnx)")
    ap.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--triton-repo", type=Path, default=None,
                    help="also write a Triton model repository for the build (runtime.triton)")
    args = ap.parse_args(argv)
    ckpt = args.checkpoint
    out = args.out if args.out is not None else Path("build") / ckpt.resolve().name
    if not ckpt.exists():
        hint = (" (the bundled zoo is not there yet: train it, or pass --checkpoint DIR)"
                if ckpt == DEFAULT_CHECKPOINT else "")
        print(f"error: {ckpt}: no such checkpoint directory{hint}", file=sys.stderr)
        return 1
    try:
        check_writable(out, ckpt)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from models.checkpoint import CheckpointError
    from export.verify import VerificationError
    try:
        build(ckpt, out, args.fuse, args.dtype)
    except (BuildError, CheckpointError, VerificationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or out}: {e.strerror or e}; nothing was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    if args.triton_repo is not None:
        try:
            from runtime.triton import RepositoryError, write_triton_repository
        except ImportError as e:
            print(f"error: --triton-repo needs runtime.triton ({e}); the build in {out} is complete", file=sys.stderr)
            return 1
        try:
            repo = write_triton_repository(out, args.triton_repo)
        except RepositoryError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"error: {e.filename or args.triton_repo}: {e.strerror or e}; the build in {out} is complete, "
                  f"the repository was not written (choose another --triton-repo)", file=sys.stderr)
            return 1
        _log(f"wrote Triton model repository {repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
