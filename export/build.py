"""python -m export.build [--fuse] [--checkpoint DIR] [--out DIR] [--dtype fp32|fp16|bf16] [--triton-repo DIR]
                        [--quantize int8|int4 [--block-size N] [--accuracy-level N] [--algo rtn|hqq] [--head int8|int4|fp32] [--int8-layers NAMES]]
                        [--target auto|ort-cpu|portable] [--attention plain|fused|gqa] [--genai] [--max-seq-len N]
                        [--kv-cache auto|fp32|fp16|int8]

--target picks the graph for the runtime it will run on (export/target.py): by default (auto) the
ONNX Runtime CPU graph with GroupQueryAttention, the fastest there, where the model and options allow
it and this machine has no TensorRT; else the portable graph (ONNX ops only, for TensorRT and every
other runtime). The build's last line says which graph is for which runtime.

checkpoint ──emit──▶ graph ──[graph_passes: fold ─▶ quantize]──▶ write, weight by weight ──▶ verify vs torch ──▶ report.json

One route for every size (export/pipeline.py): the graph is emitted from the model's spec (export/emit.py),
the passes fold and quantize each weight as it is written, and the written graph is verified against the
torch reference run block by block. Writes into OUT (default build/<checkpoint name>/) one graph:
    model.onnx         without --fuse: the graph as trained (a TaperNorm at g = 0 as a Mul by a constant vector)
    model.fused.onnx   with --fuse: scales and norm gammas folded into the MatMul weights
    model.int4.onnx    with --fuse --quantize int4 (or model.int8.onnx): the folded weights quantized
                       (ONNX Runtime's MatMulNBits, export/quantize.py) instead
    model.genai.onnx   with --fuse --genai: that graph with ONNX Runtime GenAI's I/O, the folder then loads in
    genai_config.json  og.Model(OUT) (export/genai.py); --genai implies --attention gqa
    tokenizer_config.json
    config.json        copied from the checkpoint (the converted one for a Hugging Face folder)
    tokenizer.json     copied from the checkpoint (absent when it has none)
    chat_template.json the model's chat template and special tokens (core/chat_template.py; absent when it has none)
    generation.json    the model's stop tokens, {"eos_token_ids": [...]} (core/generation.py; absent when it has none)
    report.json        op counts, folded layers, max diffs, memory estimate, timings (docs/export.md)
(a graph whose weights reach 2 GB keeps them in <graph>.data beside it).

--checkpoint may name a Hugging Face model folder (models/convert.py: its tensors are mapped as they
are read; `python -m models.convert` saves the checkpoint instead). OUT is written into a temporary
sibling and swapped into place at the end, and replaced only when it is an earlier build.
--max-seq-len N sets the KV-cache capacity of the graphs (their S_max), as `models.convert --max-seq-len`
does: a Hugging Face folder's default is min(max_position_embeddings, 2048) and N above
max_position_embeddings is refused; a checkpoint's default is the capacity it was saved with, a learned
position table allows N up to its rows, rotary positions any N (a note past the saved capacity).
--triton-repo runs `python -m runtime.triton repo` on the finished build: the repository belongs to the
runtime layer above, so it is wired here, in the CLI.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import functools
import subprocess
import sys
from pathlib import Path

from core.contract import KV_CACHE_DTYPES
from core.errors import ArgumentParser, UsageError, UserError, int_in
from core.lifecycle import run_cli
from core.outputs import BUILD, TRITON_REPOSITORY, check_output_dir
from export.target import TARGETS, resolve_target
from export.quantize import (ALGOS, BLOCK_SIZES, DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, HEAD_DTYPES, QUANT_BITS,
                             QuantConfig)

MAX_CAPACITY = 1 << 20        # the bound models.convert --max-seq-len takes
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "zoo" / "internal-taper"


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m export.build", description="Export, fuse and verify a checkpoint.")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                    help="checkpoint directory or Hugging Face model folder (default: the bundled models/zoo/internal-taper)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: build/<checkpoint name>/); replaced only if it is an earlier build")
    ap.add_argument("--fuse", action="store_true", help="fold norms/scales into weights (model.fused.onnx)")
    ap.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32",
                    help="the graph's float type; bf16 is for GPUs and TensorRT (ONNX Runtime's CPU has no bf16 "
                         "kernels: the build verifies it widened)")
    ap.add_argument("--target", choices=TARGETS, default="auto",
                    help="ort-cpu: the graphs get ONNX Runtime's GroupQueryAttention (the fastest CPU graph, ONNX "
                         "Runtime only); portable: ONNX ops only (TensorRT and other runtimes); auto (default): "
                         "ort-cpu where the model and options allow it and TensorRT is not installed, else portable")
    ap.add_argument("--attention", choices=("plain", "fused", "gqa"), default=None,
                    help="the attention ops, over --target: plain: MatMul/Softmax/... ops (portable); fused: one ONNX "
                         "Attention op per layer (opset 24, portable; ONNX Runtime runs it as one kernel); gqa (with "
                         "--fuse): ONNX Runtime's GroupQueryAttention with Q/K/V in one MatMul (--target ort-cpu)")
    ap.add_argument("--quantize", choices=tuple(QUANT_BITS), default=None,
                    help="with --fuse: write model.<int8|int4>.onnx, the folded weights quantized "
                         "(weight-only, ONNX Runtime MatMulNBits), instead of model.fused.onnx")
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
    ap.add_argument("--genai", action="store_true",
                    help="with --fuse: also make OUT a folder ONNX Runtime GenAI loads as it is (og.Model(OUT)): "
                         "model.genai.onnx (the folded GroupQueryAttention graph, or the --quantize one, with GenAI's "
                         "I/O), genai_config.json and its tokenizer files; implies --attention gqa")
    ap.add_argument("--max-seq-len", type=int_in(1, MAX_CAPACITY), default=None, metavar="N",
                    help="KV-cache capacity of the graphs (default: the checkpoint's; a Hugging Face folder's "
                         "max_position_embeddings, at most 2048, as models.convert)")
    ap.add_argument("--kv-cache", choices=("auto", *KV_CACHE_DTYPES), default="auto",
                    help="the KV caches' dtype. auto (default): int8 for the ONNX Runtime CPU graph (--target "
                         "ort-cpu) at a capacity of 4096 tokens or more when it passes its check (else fp32), fp32 "
                         "otherwise; fp16 (ort-cpu), half the bytes, its GroupQueryAttention computing on fp16 q, k, "
                         "v; int8 (ort-cpu), a quarter, with per-channel scales calibrated on text and the drift "
                         "checked (a build that drifts past the bound fails); docs/export.md")
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
        check_output_dir(args.triton_repo, TRITON_REPOSITORY, inputs=[ckpt, out], option="--triton-repo")
    from export.options import BuildOptions
    from export.pipeline import build
    opened = functools.cache(lambda: _open_weights(ckpt, args.max_seq_len))      # read once, by whichever step needs it first
    options = BuildOptions.resolved(args.fuse, args.dtype, quantize, args.genai, args.kv_cache,
                                    resolve=lambda: _target(args, opened),
                                    capacity=lambda: args.max_seq_len or opened().cfg.max_seq_len)
    _check_capacity(ckpt, opened().cfg.max_seq_len, args.max_seq_len)
    build(ckpt, out, options, source=opened())
    if args.triton_repo is not None:
        return _write_triton_repo(out, args.triton_repo)
    return 0


def _write_triton_repo(build: Path, repo: Path) -> int:
    """`python -m runtime.triton repo` on the finished build, in a child (export sits below runtime): its
    one-line error, if any, is the command's (the build stays). Interrupted, the child is given the
    signal and waited for, and the one interrupt line, this command's, names the repository when the
    child completed it (it printed that it had written nothing else, as if the repository were not there)."""
    from core.lifecycle import note_committed
    from core.outputs import marker_stamp
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
    sys.stderr.write(_as_triton_repo_error(err))
    return proc.returncode


def _check_capacity(ckpt: Path, capacity: int, given: int | None) -> None:
    """A KV cache too small for the build's verification (a prompt and 3 decode steps) is refused before the
    export: our own checkpoint's (python -m train --max-seq-len 3) crashed ONNX Runtime's TensorScatter there.
    A Hugging Face folder's is refused by models.convert as its config is read (MIN_CAPACITY)."""
    from models.convert import MIN_CAPACITY
    if given is not None and given < MIN_CAPACITY:
        raise UsageError(f"--max-seq-len {given}: expected at least {MIN_CAPACITY} (a prompt and 3 decode steps, what "
                         f"the build verifies), found {given}; pass --max-seq-len {MIN_CAPACITY} or more")
    if capacity < MIN_CAPACITY:
        raise UserError(f"{ckpt}: expected a KV-cache capacity (max_seq_len) of at least {MIN_CAPACITY} (a prompt and "
                        f"3 decode steps, what the build verifies), found {capacity}; write the checkpoint again "
                        f"with --max-seq-len {MIN_CAPACITY} or more")


def _as_triton_repo_error(err: str) -> str:
    """The child's error line in this command's terms: its --out is this command's --triton-repo, and
    its "nothing was written" leaves out the build this command wrote whole before it (written_so_far:
    `complete: OUT; nothing else was written`)."""
    from core.lifecycle import written_so_far
    lines = err.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("error: "):
            lines[i] = line.replace("another --out", "another --triton-repo").replace("nothing was written",
                                                                                      written_so_far())
    return "".join(lines)


def _open_weights(ckpt: Path, max_seq_len: int | None = None):
    """The weights, at capacity `max_seq_len` (None: the model's default). A Hugging Face folder's capacity
    is capped by its max_position_embeddings (models/convert.py): a larger N is refused here, by name."""
    from models.weights import open_weights
    source = open_weights(ckpt, max_seq_len)
    if max_seq_len is not None and source.cfg.max_seq_len != max_seq_len:
        top = source.cfg.max_seq_len
        raise UsageError(f"--max-seq-len {max_seq_len}: expected at most {top} (max_position_embeddings in "
                         f"{ckpt / 'config.json'}), found {max_seq_len}; pass --max-seq-len {top} or less")
    return source


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


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def main(argv=None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.heap import keep_freed_memory
    from core.lifecycle import exit_after
    keep_freed_memory()     # a command that ends with its build: reuse freed memory, not fault it in again (core/heap.py)
    exit_after(main)
