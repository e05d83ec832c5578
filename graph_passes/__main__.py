"""python -m graph_passes IN.onnx -o OUT.onnx [--passes a,b,...] [--strict] [--list]

Runs the passes on any ONNX decoder (ours, a user's own, an Optimum export) and
prints what each folded. Exit 0 on success, 1 on a user error (one line on
stderr), 3 when --strict and the TensorRT lint found something. OUT is written
to a temporary file and renamed into place.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import onnx

from graph_passes.base import PassError
from graph_passes.registry import DEFAULT_PASSES, PASSES, run_passes

EXIT_LINT = 3


def save_atomic(proto: onnx.ModelProto, path: str | os.PathLike) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        onnx.save(proto, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in proto.graph.node).items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graph_passes", description=__doc__.split("\n\n")[1])
    ap.add_argument("input", nargs="?", help="ONNX model to rewrite")
    ap.add_argument("-o", "--output", help="where to write the rewritten model")
    ap.add_argument("--passes", default=",".join(DEFAULT_PASSES),
                    help=f"comma-separated pass names, in order (default: {','.join(DEFAULT_PASSES)})")
    ap.add_argument("--strict", action="store_true", help=f"exit {EXIT_LINT} if trt_lint finds anything")
    ap.add_argument("--list", action="store_true", help="list the registered passes and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, cls in PASSES.items():
            print(f"{name:16s} {cls.summary}")
        return 0
    if not args.input or not args.output:
        ap.print_usage(sys.stderr)
        print("error: IN.onnx and -o OUT.onnx are required", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.passes.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        print(f"error: unknown pass {', '.join(unknown)}; known passes: {', '.join(PASSES)}", file=sys.stderr)
        return 1
    out = Path(args.output)
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        print(f"error: {out.parent}: not a writable directory; choose another -o path", file=sys.stderr)
        return 1
    try:
        proto = onnx.load(args.input)
    except FileNotFoundError:
        print(f"error: {args.input}: no such file", file=sys.stderr)
        return 1
    except Exception as e:  # onnx raises DecodeError and others on a corrupt file
        print(f"error: {args.input}: not a readable ONNX model ({type(e).__name__}); re-export it", file=sys.stderr)
        return 1
    before = op_counts(proto)
    from graph_passes.base import load_graph
    from graph_passes.taper_scale import detect_taper
    info = detect_taper(load_graph(proto))
    if info["layers"]:
        gate = "unknown (no tapernorm.gate metadata)" if info["gate"] is None else f"{info['gate']:g}"
        print(f"detected {len(info['layers'])} TaperNorm layer(s), gate {gate}: {', '.join(sorted(info['layers']))}")
    try:
        fused, results = run_passes(proto, names)
    except PassError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    save_atomic(fused, out)
    lint = []
    for r in results:
        print(f"{r.name}: {len(r.rewrites)} rewrite(s)")
        for label, detail in r.rewrites:
            print(f"  {label}: {detail}")
        for note in r.notes:
            print(f"  note: {note}")
            if note.startswith("trt: "):
                lint.append(note)
    after = op_counts(fused)
    changed = {op: (before.get(op, 0), after.get(op, 0)) for op in sorted(set(before) | set(after))
               if before.get(op, 0) != after.get(op, 0)}
    print(f"nodes {sum(before.values())} -> {sum(after.values())}" +
          ("; " + ", ".join(f"{op} {a}->{b}" for op, (a, b) in changed.items()) if changed else ""))
    print(f"wrote {out}")
    if args.strict and lint:
        print(f"error: {len(lint)} TensorRT parser issue(s) (see notes above)", file=sys.stderr)
        return EXIT_LINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
