"""python -m graph_passes IN.onnx -o OUT.onnx [--passes a,b,...] [--strict] [--verbose] [--list]

Runs the passes on any ONNX decoder (ours, a user's own, a torch.onnx or Optimum
export, an ONNX Runtime-optimized graph, If/Loop bodies included) and prints,
per pass, what it folded and every candidate it left alone and why. Exit 0 on
success, 1 on a user error (one line on stderr) and, with --strict, when the
TensorRT lint found something (OUT is still written: the graph is correct, only
not TensorRT-parsable). OUT is written to a temporary file and renamed into
place, and replaced only if this command wrote it.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

from pathlib import Path

from core.contract import load_onnx
from core.errors import ArgumentParser, UsageError, UserError
from core.lifecycle import run_cli
from core.outputs import FUSED_ONNX, output_file, sign_onnx
from graph_passes.base import op_counts
from graph_passes.registry import DEFAULT_PASSES, PASSES, run_passes

SHOWN_FINDINGS = 10      # per pass without --verbose


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m graph_passes", description=__doc__.split("\n\n")[1])
    ap.add_argument("input", nargs="?", help="ONNX model to rewrite")
    ap.add_argument("-o", "--output", help="where to write the rewritten model (a new file, or one this command wrote)")
    ap.add_argument("--passes", default=",".join(DEFAULT_PASSES),
                    help=f"comma-separated pass names, in order (default: {','.join(DEFAULT_PASSES)})")
    ap.add_argument("--strict", action="store_true", help="exit 1 if trt_lint finds anything")
    ap.add_argument("--verbose", action="store_true",
                    help=f"print every candidate left alone (default: the first {SHOWN_FINDINGS} per pass)")
    ap.add_argument("--list", action="store_true", help="list the registered passes and exit")
    return ap


def _print_results(results, verbose: bool) -> None:
    """Per pass: what it folded, and the candidates it left alone (the first few unless verbose)."""
    for r in results:
        counts = f"{len(r.lint)} issue(s)" if r.lint else f"{len(r.folded)} folded, {len(r.skipped)} skipped"
        print(f"{r.name}: {counts}")
        for f in r.folded:
            print(f"  {f.where}: {f.detail}")
        shown = r.findings if verbose else r.findings[:SHOWN_FINDINGS]
        for f in shown:
            print(f"  {'lint' if f.kind == 'lint' else 'note'}: {f}")
        if len(shown) < len(r.findings):
            print(f"  ... {len(r.findings) - len(shown)} more (--verbose prints all)")


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, cls in PASSES.items():
            print(f"{name:16s} {cls.summary}")
        return 0
    if not args.input or not args.output:
        raise UsageError("python -m graph_passes: IN.onnx and -o OUT.onnx are required; see --help")
    names = [n.strip() for n in args.passes.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES]
    if unknown or not names:
        raise UserError(f"--passes {args.passes!r}: unknown pass {', '.join(unknown) or '(none given)'}; "
                        f"known passes: {', '.join(PASSES)}")
    out = Path(args.output)
    from core.outputs import check_output_file
    check_output_file(out, FUSED_ONNX, inputs=[args.input])      # before the (slow) load
    proto = load_onnx(args.input)
    before = op_counts(proto)
    from graph_passes.base import load_graph
    from graph_passes.taper_scale import detect_taper
    info = detect_taper(load_graph(proto))
    if info["layers"]:
        gate = "unknown (no tapernorm.gate metadata)" if info["gate"] is None else f"{info['gate']:g}"
        print(f"detected {len(info['layers'])} TaperNorm layer(s), gate {gate}: {', '.join(sorted(info['layers']))}")
    fused, results = run_passes(proto, names)
    from core.onnx_writer import EXTERNAL_AT, inline_bytes, save_onnx
    if inline_bytes(fused) >= EXTERNAL_AT:      # one .onnx file holds < 2 GB; bigger graphs are export.build's
        raise UserError(f"{args.input}: expected a graph under {EXTERNAL_AT / 1e9:.1f} GB of weights for one output "
                        f"file, found {inline_bytes(fused) / 1e9:.1f} GB; run python -m export.build --fuse instead")
    with output_file(out, FUSED_ONNX, inputs=[args.input]) as tmp:
        save_onnx(sign_onnx(fused), tmp)
    _print_results(results, args.verbose)
    lint = [issue for r in results for issue in r.lint]
    folded = sum(len(r.folded) for r in results if r.name != "fold_constants")
    skipped = sum(len(r.skipped) for r in results)
    after = op_counts(fused)
    changed = {op: (before.get(op, 0), after.get(op, 0)) for op in sorted(set(before) | set(after))
               if before.get(op, 0) != after.get(op, 0)}
    print(f"folded {folded}, skipped {skipped}; nodes {sum(before.values())} -> {sum(after.values())}" +
          ("; " + ", ".join(f"{op} {a}->{b}" for op, (a, b) in changed.items()) if changed else ""))
    print(f"wrote {out}")
    if args.strict and lint:
        raise UserError(f"{out}: {len(lint)} TensorRT parser issue(s) (the lint lines above); --strict "
                        "refuses them: rewrite those nodes, or drop --strict")
    return 0


def main(argv=None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
