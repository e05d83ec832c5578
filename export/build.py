"""python -m export.build [--fuse] [--checkpoint DIR] [--out DIR] [--dtype fp32|fp16] [--triton-repo DIR]

checkpoint ──export──▶ model.onnx ──verify vs torch──▶ [graph_passes ──▶ model.fused.onnx ──verify──▶] report.json

Writes into OUT (default build/<checkpoint name>/):
    model.onnx         the unfused export (TaperNorm at g=0 as Mul by a constant vector)
    model.fused.onnx   with --fuse: scales and norm gammas folded into the MatMul weights
    config.json        copied from the checkpoint (the converted one for a Hugging Face folder)
    tokenizer.json     copied from the checkpoint (absent when it has none)
    report.json        op counts before/after, folded layers, max diffs, timings (docs/export.md)

--checkpoint may name a Hugging Face model folder (gpt2, llama, mistral, qwen2):
it is converted in memory (models/convert.py; `python -m models.convert` saves
the checkpoint instead). The stages live in export/pipeline.py. OUT is written into a temporary sibling and
swapped into place at the end, and replaced only when it is an earlier build.
--triton-repo runs `python -m runtime.triton repo` on the finished build: the
repository belongs to the runtime layer above, so it is wired here, in the CLI.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core.errors import ArgumentParser, UserError, run_cli
from core.outputs import BUILD, TRITON_REPOSITORY, check_output_dir

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "zoo" / "internal-taper"


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m export.build", description="Export, fuse and verify a checkpoint.")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                    help="checkpoint directory or Hugging Face model folder (default: the bundled models/zoo/internal-taper)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: build/<checkpoint name>/); replaced only if it is an earlier build")
    ap.add_argument("--fuse", action="store_true", help="also fold norms/scales into weights (model.fused.onnx)")
    ap.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--triton-repo", type=Path, default=None,
                    help="also write a Triton model repository for the build (python -m runtime.triton repo)")
    return ap


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    ckpt = args.checkpoint
    out = args.out if args.out is not None else Path("build") / ckpt.resolve().name
    if not ckpt.is_dir():
        hint = (" (the bundled zoo is not there: reinstall, or pass --checkpoint DIR)"
                if ckpt == DEFAULT_CHECKPOINT else "")
        found = "a file" if ckpt.exists() else "nothing"
        raise UserError(f"{ckpt}: expected a checkpoint directory, found {found}{hint}; pass --checkpoint DIR")
    check_output_dir(out, BUILD, inputs=[ckpt])
    if args.triton_repo is not None:        # refuse before an export that would be wasted
        check_output_dir(args.triton_repo, TRITON_REPOSITORY, inputs=[ckpt, out])
    from export.pipeline import build
    build(ckpt, out, args.fuse, args.dtype)
    if args.triton_repo is not None:
        cmd = [sys.executable, "-m", "runtime.triton", "repo", "--build", str(out), "--out", str(args.triton_repo)]
        return subprocess.run(cmd).returncode      # its own one-line error, if any; the build stays
    return 0


def main(argv=None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.errors import exit_after
    exit_after(main())
