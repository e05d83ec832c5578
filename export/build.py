"""python -m export.build [--fuse] [--checkpoint DIR] [--out DIR] [--dtype fp32|fp16|bf16] [--triton-repo DIR]
                        [--quantize int8|int4 [--block-size N] [--accuracy-level N] [--algo rtn|hqq] [--head int8|int4|fp32] [--int8-layers NAMES]]
                        [--target auto|ort-cpu|portable] [--attention plain|fused|gqa] [--genai] [--route auto|in-memory|streamed]

--target picks the graph for the runtime it will run on (export/target.py): by default (auto) the
ONNX Runtime CPU graph with GroupQueryAttention, the fastest there, where the model and options allow
it and this machine has no TensorRT; else the portable graph (ONNX ops only, for TensorRT and every
other runtime). The build's last line says which graph is for which runtime.

checkpoint ──export──▶ model.onnx ──verify vs torch──▶ [graph_passes ──▶ model.fused.onnx ──verify──▶] report.json

Writes into OUT (default build/<checkpoint name>/):
    model.onnx         the unfused export (TaperNorm at g=0 as Mul by a constant vector)
    model.fused.onnx   with --fuse: scales and norm gammas folded into the MatMul weights
    model.int4.onnx    with --fuse --quantize int4 (or model.int8.onnx): the folded weights
                       quantized (export/quantize.py), verified against model.fused.onnx
    model.genai.onnx   with --fuse --genai: the folded GroupQueryAttention graph (or its --quantize
    genai_config.json  graph) with ONNX Runtime GenAI's I/O, the folder then loads in og.Model(OUT)
    tokenizer_config.json  (export/genai.py); --genai implies --attention gqa
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

from core.errors import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import functools
import subprocess
import sys
from pathlib import Path

from core.errors import ArgumentParser, UsageError, UserError, int_in, run_cli
from core.outputs import BUILD, TRITON_REPOSITORY, check_output_dir
from export.target import TARGETS, resolve_target
from export.quantize import (ALGOS, BLOCK_SIZES, DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, HEAD_DTYPES, QUANT_BITS,
                             QuantConfig)

ROUTES = ("auto", "in-memory", "streamed")
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "zoo" / "internal-taper"


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m export.build", description="Export, fuse and verify a checkpoint.")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                    help="checkpoint directory or Hugging Face model folder (default: the bundled models/zoo/internal-taper)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: build/<checkpoint name>/); replaced only if it is an earlier build")
    ap.add_argument("--fuse", action="store_true", help="also fold norms/scales into weights (model.fused.onnx)")
    ap.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32",
                    help="the graph's float type; bf16 (for GPUs and TensorRT; ONNX Runtime's CPU has no bf16 "
                         "kernels) is built by the streamed route")
    ap.add_argument("--target", choices=TARGETS, default="auto",
                    help="ort-cpu: the graphs get ONNX Runtime's GroupQueryAttention (the fastest CPU graph, ONNX "
                         "Runtime only); portable: ONNX ops only (TensorRT and other runtimes); auto (default): "
                         "ort-cpu where the model and options allow it and TensorRT is not installed, else portable")
    ap.add_argument("--attention", choices=("plain", "fused", "gqa"), default=None,
                    help="the attention ops, over --target: plain: MatMul/Softmax/... ops (portable); fused: one ONNX "
                         "Attention op per layer (opset 24, portable; ONNX Runtime runs it as one kernel); gqa (with "
                         "--fuse): ONNX Runtime's GroupQueryAttention with Q/K/V in one MatMul (--target ort-cpu)")
    ap.add_argument("--quantize", choices=tuple(QUANT_BITS), default=None,
                    help="with --fuse: also write model.<int8|int4>.onnx, the folded weights quantized "
                         "(weight-only, ONNX Runtime MatMulNBits)")
    ap.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=DEFAULT_BLOCK_SIZE,
                    help=f"--quantize: weights per scale (default {DEFAULT_BLOCK_SIZE})")
    ap.add_argument("--accuracy-level", type=int_in(0, 4), default=DEFAULT_ACCURACY_LEVEL,
                    help=f"--quantize: MatMulNBits compute type: 0 default, 1 fp32, 2 fp16, 3 bf16, 4 int8 "
                         f"(default {DEFAULT_ACCURACY_LEVEL})")
    ap.add_argument("--algo", choices=ALGOS, default="rtn",
                    help="--quantize: rtn (round to nearest, default) or hqq (int4 only)")
    ap.add_argument("--head", choices=HEAD_DTYPES, default=None,
                    help="--quantize: the LM head's weight dtype (default: the --quantize dtype); "
                         "--quantize int4 --head int8 keeps top-1 agreement higher for more bytes per token")
    ap.add_argument("--int8-layers", type=_names, default=(), metavar="NAME[,NAME...]",
                    help="--quantize int4: layers kept in int8, by module name or its last part, e.g. "
                         "v_proj,down_proj (llama.cpp's Q4_K_M keeps attention V and the MLP down in more bits)")
    ap.add_argument("--route", choices=ROUTES, default="auto",
                    help="in-memory: the whole model held (every stage on the graph, model.onnx and model.fused.onnx); "
                         "streamed: weights read, folded and written block by block into one graph "
                         "(model.fused.onnx, or model.<q>.onnx with --quantize), for models too large to hold; "
                         "auto (default): in-memory when its memory estimate fits, else streamed")
    ap.add_argument("--genai", action="store_true",
                    help="with --fuse: also make OUT a folder ONNX Runtime GenAI loads as it is (og.Model(OUT)): "
                         "model.genai.onnx (the folded GroupQueryAttention graph, or the --quantize one, with GenAI's "
                         "I/O), genai_config.json and its tokenizer files; implies --attention gqa")
    ap.add_argument("--triton-repo", type=Path, default=None,
                    help="also write a Triton model repository for the build (python -m runtime.triton repo)")
    return ap


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    quantize = _quant_config(args)
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
    from export.pipeline import build, check_options, check_quantize
    check_quantize(quantize, args.fuse, args.dtype)         # before the target: it reads the config
    opened = functools.cache(lambda: _open_weights(ckpt))      # read once, by whichever step needs it first
    target = _target(args, opened)
    check_options(quantize, args.genai, args.fuse, args.dtype, target.attention)
    source = _streamed(args.route, opened, args.dtype)
    if source is not None:
        from export.streamed import build_streamed
        build_streamed(ckpt, out, args.fuse, args.dtype, quantize=quantize, attention=target.attention, source=source,
                       genai=args.genai, target_why=target.why)
    else:
        build(ckpt, out, args.fuse, args.dtype, quantize=quantize, attention=target.attention, genai=args.genai,
              target_why=target.why)
    if args.triton_repo is not None:
        return _write_triton_repo(out, args.triton_repo)
    return 0


def _write_triton_repo(build: Path, repo: Path) -> int:
    """`python -m runtime.triton repo` on the finished build, in a child (export sits below runtime): its
    one-line error, if any, is the command's (the build stays). Interrupted, the child is given the
    signal and waited for, and the one interrupt line, this command's, names the repository when the
    child completed it (it printed that it had written nothing else, as if the repository were not there)."""
    from core.outputs import marker_stamp, note_committed
    before = marker_stamp(repo)
    proc = subprocess.Popen([sys.executable, "-m", "runtime.triton", "repo", "--build", str(build), "--out", str(repo)],
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate()
    except KeyboardInterrupt:
        try:                # a terminal's Ctrl-C reached it too: a second signal could stop its clean-up midway
            proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            proc.terminate()     # (a SIGTERM to this command alone; SIGTERM: a background job ignores SIGINT)
            try:
                proc.communicate(timeout=60)     # it removes its temporary; its own interrupt line is dropped
            except subprocess.TimeoutExpired:
                proc.kill()
        if marker_stamp(repo) not in (None, before):
            note_committed(repo)
        raise
    sys.stderr.write(err)
    return proc.returncode


def _open_weights(ckpt: Path):
    from models.weights import open_weights
    return open_weights(ckpt)


def _target(args, opened):
    """--target and --attention resolved (export/target.py); the model's config is read only when
    --target auto or ort-cpu has to check it (safetensors headers and config.json, no weights)."""
    if args.target == "portable" or (args.attention is not None and not args.genai) or not args.fuse:
        cfg = None
    else:
        cfg = opened().cfg
    return resolve_target(args.target, args.attention, args.fuse, args.dtype, args.genai, cfg)


def _quant_config(args) -> QuantConfig | None:
    """--quantize and its options; the options alone are a usage error (they would do nothing)."""
    if args.quantize is None:
        given = [o for o, v, d in (("--block-size", args.block_size, DEFAULT_BLOCK_SIZE),
                                   ("--accuracy-level", args.accuracy_level, DEFAULT_ACCURACY_LEVEL),
                                   ("--algo", args.algo, "rtn"), ("--head", args.head, None),
                                   ("--int8-layers", args.int8_layers, ())) if v != d]
        if given:
            raise UsageError(f"{', '.join(given)}: expected --quantize int8|int4 with it, found none; "
                             "add --quantize int4 (or drop the option)")
        return None
    return QuantConfig(args.quantize, args.block_size, args.accuracy_level, args.algo, args.head, args.int8_layers)


def _streamed(route: str, opened, dtype: str):
    """The opened weights (models.weights.WeightSource) when the build streams: asked for, bf16, or
    (auto) the in-memory build would not fit here; else None. Opened once: the streamed build reuses them."""
    if route == "in-memory" and dtype == "bf16":
        raise UsageError("--dtype bf16: expected --route streamed or auto (bf16 graphs are written by the streamed "
                         "build, each weight cast from fp32 once); drop --route in-memory")
    if route == "in-memory":
        return None
    from core.inputs import available_memory, human_bytes
    from export.streamed import in_memory_peak
    source = opened()
    if route == "streamed" or dtype == "bf16":
        return source
    cfg, avail = source.cfg, available_memory()
    if avail is None or in_memory_peak(cfg) <= avail:
        return None
    print(f"note: {cfg.approx_param_count() / 1e9:.2f}B parameters: the in-memory build would need "
          f"~{human_bytes(in_memory_peak(cfg))}, {human_bytes(avail)} available; streaming the weights "
          "(--route streamed)")
    return source


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def main(argv=None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.errors import exit_after
    exit_after(main())
