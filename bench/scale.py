"""python -m bench.scale make SHAPE --out DIR [--layers N] [--seed N] [--dtype bf16|fp16|fp32] [--shard-gb G]
python -m bench.scale run --shapes SHAPE[,SHAPE...] --work DIR --options "NAME=BUILD ARGS[;NAME=BUILD ARGS...]"
                          [--rounds N] [--decode-tokens N] [--threads N] [--layers N] [--peers genai,llamacpp]
                          [--gguf FILE] [--llama-bench BIN] [--reuse-builds]
                          [--depths N,N,...] [--prefills N,N,...] [--memory-cap GB] --json OUT.json
python -m bench.scale plot REPORT.json [REPORT.json...] --out FIGURE.png
python -m bench.scale drift REFERENCE.onnx OTHER.onnx [--prompt-tokens N] [--new-tokens N] [--threads N]

What `python -m export.build` costs at real model sizes, and what its graphs decode at on CPU.

make writes a random-init Hugging Face folder of a real shape (bench/shapes.py: llama-3.2-1b,
llama-3.2-3b, llama-3-8b, qwen2.5-0.5b, gpt2-medium, gpt2-xl, qwen3-0.6b, qwen3-1.7b, qwen3-4b,
qwen3-8b, gemma-3-1b, gemma-3-4b, phi-4-mini, smollm3-3b, olmo-2-1b; or a config .json path), shard by
shard, without building the model. run, for each shape: makes DIR/<shape> (reused when it is
already that shape), then in interleaved rounds (bench.stats.round_order) runs, per option set,

    python -m export.build --checkpoint DIR/<shape> --out DIR/build-<shape>-<option> <options>

in a child process: wall seconds, peak resident memory (the child's ru_maxrss, read by a small
wrapper process that starts it), exit code, the build folder's bytes; then the decode speed of
the graph it wrote (model.int4.onnx, model.int8.onnx, model.fused.onnx or model.onnx, the first
found) in another child (`python -m bench.scale decode GRAPH`): runtime.ort_session.OrtSession,
batch 1, a prompt of --prompt-tokens random ids, an untimed warm-up, then --decode-tokens greedy
steps at --threads intra-op threads; tokens/s over the decode steps only, and that child's peak
RSS. --peers genai adds ONNX Runtime GenAI's model builder (`-p int4 -e cpu`, fed the folder plus
a tokenizer, which the builder needs) measured the same way, decoded with bench.genai's runner.
--peers llamacpp adds llama.cpp (one shape; --gguf: the GGUF of that shape's folder, e.g. Q4_0 from
`python -m bench.llamacpp gguf`): in each round, in its turn, llama.cpp's own `llama-bench` (--llama-bench)
decodes --decode-tokens tokens at each depth and prefills each prompt length with flash attention on and
off (`-fa on,off -r 1`), two rows (llamacpp-fa-on, llamacpp-fa-off); with a llama.cpp peer the table adds
ours / the faster of the two, per round (median [min, max]). --reuse-builds decodes a build folder that
an earlier run of bench.scale wrote with the same arguments instead of building it again (its row says
so and has no build figures), for runs about decode and prefill speed alone.
A failed build is reported with its last error line; a bf16 graph is built and measured but not
decoded (ONNX Runtime's CPU has no bf16 kernels). Every child runs under --memory-cap: its process
tree is stopped when it passes the cap (and the row says so) instead of meeting the kernel's OOM
killer. GB are 10^9 bytes.

--depths 0,1024,4096,8192 and --prefills 128,1024,4096 add the cost of context to the decode child
(the same session, after its warm-up): per depth d, a real prefill of d random tokens (1 for d = 0)
then --decode-tokens greedy steps, decode tokens/s at that depth (the steps only); per prompt
length P, one prefill of P tokens, prefill tokens/s = P / time to first token. Each is summarized
over rounds (min / median / max) in the report, the table and the plot (decode tokens/s against
depth). The graph's capacity must hold the deepest d + --decode-tokens + 1 and the longest P: build
with `--max-seq-len N` in the option (e.g. "int4=--fuse --quantize int4 --max-seq-len 8448"); a
graph that cannot is reported as that row's error. The GenAI peer is measured the same way.

drift compares two graphs of one model that differ in how they compute (--kv-cache fp16 against
fp32, a quantized graph against the float one): the reference generates --new-tokens greedy
tokens after a random prompt of --prompt-tokens ids; the other reads the same prompt and tokens
(teacher-forced) and its logits are compared at every position, max |d| / max |reference| over
the prompt and over the steps; it also generates on its own, and the greedy agreement is the share
of the new tokens both chose, with the first position where they part. One JSON line.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import stats
from bench.shapes import DTYPES, folder_config, folder_matches, human, resolve_shape, tensor_specs, write_random_folder
from core.build_files import FUSED, QUANTIZED, UNFUSED
from core.errors import ArgumentParser, UsageError, UserError, float_in, int_in, positive_int
from core.lifecycle import run_cli
from core.outputs import (BENCH_CACHE, BUILD, FIGURE, REPORT_JSON, SCALE_FOLDER, check_output_dir, check_output_file,
                          is_earlier_output, marker_stamp, output_dir, output_file, png_signature_metadata, write_json)

GRAPHS = (*QUANTIZED, FUSED, UNFUSED)    # decoded: the first found (ONNX Runtime's order, runtime/model_files.py)
PEERS = ("genai", "llamacpp")
GENAI = "genai-int4"
LLAMACPP = "llamacpp"            # the round's slot of llama-bench, which gives the two rows below
LLAMACPP_ROWS = {1: "llamacpp-fa-on", 0: "llamacpp-fa-off"}      # by llama-bench's flash_attn
OPTION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*$")
GB = 1e9
ROOT = Path(__file__).resolve().parent.parent
# the children run this checkout's export.build and runtime, whatever the working directory
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


# --- measuring a child process ---------------------------------------------------------------------

# The child's peak is read in a small wrapper process that starts it (its memory readings are
# runtime.process_memory's, the one module it imports of ours). Read in this process instead
# (os.wait4, RUSAGE_CHILDREN), it could never be below this process's own peak: Linux carries the
# parent's high-water RSS into a forked child's ru_maxrss across its exec, and this process has
# held a whole shard while writing a folder.
# The wrapper also keeps the child's process tree under a memory cap: a peer that would meet the
# kernel's OOM killer (GenAI's builder on an 8B folder here) is stopped instead, and the row says
# so, rather than the killer picking a victim on a shared machine.
# Each process of the chain (bench.scale -> wrapper -> child) is told by the kernel when its parent dies
# (PR_SET_PDEATHSIG, SIGTERM): a bench.scale killed by SIGKILL, which it cannot catch to stop its
# children, left the child build running on; SIGTERM lets the child remove its temporaries.
WRAPPER = """import ctypes, os, signal, subprocess, sys, time
from runtime.process_memory import peak_rss_bytes, process_tree, rss_bytes
t0 = time.perf_counter()
cap = int(sys.argv[2])

def die_with_parent(parent):
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)                 # PR_SET_PDEATHSIG
    if os.getppid() != parent:                                  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)

die_with_parent(int(sys.argv[3]))
me = os.getpid()
p = subprocess.Popen(sys.argv[4:], preexec_fn=lambda: die_with_parent(me))
signal.signal(signal.SIGINT, signal.SIG_IGN)                    # a terminal's Ctrl-C reaches the child itself
signal.signal(signal.SIGTERM, lambda *a: p.terminate())

capped = 0
while p.poll() is None:
    time.sleep(0.25)
    pids = process_tree(p.pid) if cap else []
    now = rss_bytes(pids)
    if cap and now > cap:
        capped = now
        for q in reversed(pids):
            try:
                os.kill(q, signal.SIGKILL)
            except OSError:
                pass
        break
rc = p.wait()
with os.fdopen(int(sys.argv[1]), "w") as f:
    f.write(f"{rc} {time.perf_counter() - t0} {peak_rss_bytes(children=True)} {capped}")
"""


def measured(cmd: list[str], cap_bytes: int = 0) -> dict:
    """Run cmd to its end: exit code, wall seconds, peak RSS of it (and its children), stdout, last
    error line. With cap_bytes, its process tree is killed when its resident memory passes the cap."""
    # the wrapper's usage line goes to an unlinked file passed as a descriptor: nothing named is left in
    # the temporary folder when this process is killed
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile("w+") as usage:
        proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(usage.fileno()), str(int(cap_bytes)),
                                 str(os.getpid()), *cmd], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=CHILD_ENV, pass_fds=(usage.fileno(),))
        try:
            proc.wait()
        except BaseException:           # Ctrl-C / SIGTERM: let the child clean up its temporaries first
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        # the wrapper itself killed (SIGKILL, out of memory) leaves no usage line
        usage.seek(0)
        rc, wall, peak, capped = usage.read().split() or (proc.returncode, "nan", 0, 0)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    rc = int(rc)
    lines = [ln.strip() for ln in (stderr or stdout).splitlines() if ln.strip()]
    error = (lines[-1] if lines else f"exit code {rc}, no output") if rc else None
    if int(capped):
        error = (f"stopped by the bench at {int(capped) / GB:.1f} GB resident (--memory-cap {cap_bytes / GB:.1f} GB), "
                 "before the kernel's OOM killer")
    return {"rc": rc, "wall_s": round(float(wall), 2), "peak_rss_bytes": int(peak), "stdout": stdout,
            "error": error, "capped": bool(int(capped))}


def folder_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if not os.path.islink(os.path.join(d, f)))


# --- the decode child ------------------------------------------------------------------------------

def decode_speed(model: str, decode_tokens: int, prompt_tokens: int, threads: int, genai: bool = False,
                 depths: tuple[int, ...] = (), prefills: tuple[int, ...] = ()) -> dict:
    """Greedy decode at batch 1 after an untimed warm-up; tokens/s over the decode steps only. With
    `depths`: the same after a prefill of d tokens, per d; with `prefills`: P / time to first token of a
    prompt of P tokens, per P (see the module doc)."""
    t0 = time.perf_counter()
    if genai:
        from bench.genai import GenAIRunner
        runner = GenAIRunner({"path": model, "precision": "int4", "weight_bytes": 0, "source": "bench.scale"}, threads)
        runner.activate()
        vocab = json.loads((Path(model) / "genai_config.json").read_text())["model"]["vocab_size"]

        def run(prompt, n):            # -> (time to first token s, [decode step s])
            t = runner.generate(prompt[None], n)
            return t.ttft_s, t.step_s
    else:
        from runtime.generate import GenerationConfig, generate
        from runtime.ort_session import OrtSession
        session = OrtSession(model, intra_op_threads=threads).activate()
        vocab = session.spec.vocab_size

        def run(prompt, n):
            r = generate(session, [prompt.tolist()], GenerationConfig(max_new_tokens=n))
            return r.ttft_s, r.step_s
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, prompt_tokens, dtype=np.int64)
    run(prompt, 4)                                          # untimed warm-up
    _, steps = run(prompt, decode_tokens + 1)               # the first new token comes from the prefill
    out = {"tokens_per_s": len(steps) / sum(steps), "steps": len(steps), "load_s": round(load_s, 2),
           "tpot_ms_p50": stats.median(steps) * 1e3}
    if depths:
        out["depths"] = {}
        for d in depths:            # a real prefill of d tokens, then the steps at depth d + 1, d + 2, ...
            ttft, steps = run(rng.integers(0, vocab, max(d, 1), dtype=np.int64), decode_tokens + 1)
            out["depths"][str(d)] = {"tokens_per_s": len(steps) / sum(steps), "tpot_ms_p50": stats.median(steps) * 1e3,
                                     "steps": len(steps), "prefill_s": ttft}
    if prefills:
        out["prefills"] = {}
        for n in prefills:
            ttft, _ = run(rng.integers(0, vocab, n, dtype=np.int64), 1)
            out["prefills"][str(n)] = {"tokens_per_s": n / ttft, "ttft_ms": ttft * 1e3}
    return out


def graph_drift(reference: str, other: str, prompt_tokens: int, new_tokens: int, threads: int, seed: int = 0) -> dict:
    """The other graph's logits against the reference's on the reference's greedy text, and the two
    greedy texts' agreement (see the module doc); batch 1, OrtSession (the caches each graph declares)."""
    from runtime.ort_session import OrtSession
    ref, oth = (OrtSession(m, intra_op_threads=threads).activate() for m in (reference, other))
    for s in (ref, oth):
        s.reset(1)
    if ref.spec.vocab_size != oth.spec.vocab_size:
        raise UserError(f"{other}: expected the vocabulary of {reference} ({ref.spec.vocab_size}), found "
                         f"{oth.spec.vocab_size}; compare two graphs of one model")
    need = prompt_tokens + new_tokens
    for path, s in ((reference, ref), (other, oth)):
        if s.spec.capacity < need:
            raise UserError(f"{path}: expected a cache of at least {need} slots (--prompt-tokens + --new-tokens), "
                             f"found {s.spec.capacity}; build with --max-seq-len {need} or ask for fewer tokens")
    prompt = np.random.default_rng(seed).integers(0, ref.spec.vocab_size, (1, prompt_tokens), dtype=np.int64)

    def scaled(a, b) -> float:
        return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(a).max(), 1e-30))
    a, b = ref.prefill(prompt)[0].copy(), oth.prefill(prompt)[0].copy()                  # [T, V]
    prefill_drift = scaled(a, b)
    tokens, step_drift, tok = [], 0.0, int(a[-1].argmax())
    for t in range(new_tokens):                        # the reference's greedy text, read by both
        tokens.append(tok)
        pos = np.array([prompt_tokens + t], np.int64)
        x, y = ref.decode_step(np.array([tok]), pos), oth.decode_step(np.array([tok]), pos)
        step_drift = max(step_drift, scaled(x[0], y[0]))
        tok = int(x[0].argmax())
    oth.reset(1)
    own = [int(oth.prefill(prompt)[0, -1].argmax())]
    for t in range(new_tokens - 1):                    # the other's own greedy text
        own.append(int(oth.decode_step(np.array([own[-1]]), np.array([prompt_tokens + t], np.int64))[0].argmax()))
    same = [x == y for x, y in zip(tokens, own)]
    return {"reference": str(reference), "other": str(other), "caches": [ref.spec.dtype, oth.spec.dtype],
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "prefill_logits_drift": prefill_drift, "step_logits_drift": step_drift,
            "greedy_agreement": sum(same) / len(same), "first_difference": same.index(False) if not all(same) else None}


# --- run ------------------------------------------------------------------------------------------

def parse_options(text: str) -> dict[str, list[str]]:
    """'name=--fuse --quantize int4;fp32=--fuse' -> {name: build args}."""
    options = {}
    for item in [s.strip() for s in text.split(";") if s.strip()]:
        name, eq, args = item.partition("=")
        name = name.strip()
        if not eq or not OPTION_NAME.match(name) or name in options or name == GENAI:
            raise UsageError(f"--options {item!r}: expected NAME=BUILD ARGS with a new name of letters, digits, "
                             f"'.', '_', '-' (not {GENAI}), found {'no =' if not eq else repr(name)}; "
                             "e.g. --options \"int4=--fuse --quantize int4;fp32=--fuse\"")
        try:
            argv = shlex.split(args)
        except ValueError as e:         # an unbalanced quote
            raise UsageError(f"--options {name}: {args.strip()!r} cannot be split as a shell line ({e}); "
                             "close the quote") from None
        taken = [a for a in argv if a.split("=")[0] in ("--checkpoint", "--out", "--triton-repo")]
        if taken:
            raise UsageError(f"--options {name}: {taken[0].split('=')[0]} is set by bench.scale; drop it")
        options[name] = argv
    if not options:
        raise UsageError("--options: expected at least one NAME=BUILD ARGS, found none; e.g. --options \"fp32=--fuse\"")
    return options


def genai_input(folder: Path, out: Path) -> Path:
    """The folder's files (linked) plus a tokenizer: GenAI's builder loads one and fails without it."""
    from bench.genai import TOKENIZER
    from transformers import PreTrainedTokenizerFast
    with output_dir(out, SCALE_FOLDER, inputs=[folder]) as tmp:
        for f in folder.iterdir():
            if not f.name.startswith("."):
                (tmp / f.name).symlink_to(f.resolve())
        PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>",
                                bos_token="<|endoftext|>").save_pretrained(tmp)
    return out


class _BuildFailed(Exception):
    """A measured build that did not succeed: its temporary folder is dropped, the earlier one kept."""


def genai_build(inp: Path, out: Path, cache: Path, cap_bytes: int = 0) -> dict:
    """GenAI's model builder into `out`, measured. `out` is written as every output of ours is
    (core.outputs.output_dir: a marked temporary sibling renamed into place when the build succeeds),
    so an earlier folder there is replaced only when it carries the marker of a bench build; one
    that merely holds a genai_config.json is the user's. A failed or stopped build leaves nothing."""
    row = {}
    try:
        with output_dir(out, BENCH_CACHE, inputs=[inp]) as tmp:
            # GenAI's own builder, given a Gemma 3 config the way it reads one (bench/genai_builder.py)
            row = measured([sys.executable, "-m", "bench.genai_builder", "-i", str(inp), "-o", str(tmp),
                            "-p", "int4", "-e", "cpu", "-c", str(cache)], cap_bytes)
            if row["rc"] != 0:
                raise _BuildFailed
    except _BuildFailed:
        pass
    return row


def build_record(out: Path) -> Path:
    """Beside a build folder bench.scale wrote: the arguments it built with and the marker it got (--reuse-builds)."""
    return out.with_name(out.name + ".bench-args.json")


def reusable(out: Path, argv: list[str], folder: Path, kind) -> bool:
    """Whether `out` is the finished build an earlier bench.scale run wrote from `folder` with these arguments: its
    record names them and the build's own marker (a folder written again since, by anyone, is not that build)."""
    try:
        record = json.loads(build_record(out).read_text())
    except (OSError, ValueError):
        return False
    stamp = marker_stamp(out)
    return (is_earlier_output(out, kind, made_after=folder) and stamp is not None
            and record.get("build_args") == argv and record.get("marker") == list(stamp))


def measure_option(name: str, argv: list[str], folder: Path, out: Path, args, genai_in: Path | None = None) -> dict:
    """One build of one option set (or, with --reuse-builds, the same build from an earlier run) and, when it
    succeeded, the decode speed of what it wrote."""
    kind = BENCH_CACHE if name == GENAI else BUILD
    if getattr(args, "reuse_builds", False) and reusable(out, argv, folder, kind):
        row = {"rc": 0, "reused": True, "wall_s": None, "peak_rss_bytes": None, "stdout": "", "error": None,
               "capped": False}
    elif name == GENAI:
        row = genai_build(genai_in, out, args.work / "genai-cache", args.cap_bytes)
    else:
        row = measured([sys.executable, "-m", "export.build", "--checkpoint", str(folder), "--out", str(out), *argv],
                       args.cap_bytes)
    stamp = marker_stamp(out) if row["rc"] == 0 and not row.get("reused") else None
    if stamp is not None:
        write_json(build_record(out), {"build_args": argv, "marker": list(stamp)})
    if name == GENAI:
        graph = out if row["rc"] == 0 and (out / "genai_config.json").is_file() else None   # not an earlier one
    else:
        graph = next((out / g for g in GRAPHS if (out / g).is_file()), None) if row["rc"] == 0 else None
    del row["stdout"]
    row["output_bytes"] = folder_bytes(out) if row["rc"] == 0 and out.is_dir() else 0
    if row["rc"] == 0 and graph is None:
        row["rc"], row["error"] = -1, f"{out}: the build wrote none of {', '.join(GRAPHS)}"
    if graph is None:
        return row
    row["graph"] = graph.name
    from core.contract import contract_of
    if name != GENAI and contract_of(graph).dtype == "bf16":      # (the graph read, not its weights)
        row["decode"] = {"skipped": "bf16: ONNX Runtime's CPU kernels do not compute bf16 (bench/gpu_check.sh does)"}
        return row
    cmd = [sys.executable, "-m", "bench.scale", "decode", str(graph), "--decode-tokens", str(args.decode_tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--threads", str(args.threads)] + (["--genai"] if name == GENAI else [])
    for flag, values in (("--depths", getattr(args, "depths", ())), ("--prefills", getattr(args, "prefills", ()))):
        cmd += [flag, ",".join(map(str, values))] if values else []
    dec = measured(cmd, args.cap_bytes)
    if dec["rc"] == 0:
        dec.update(json.loads(dec["stdout"].strip().splitlines()[-1]))
    del dec["stdout"]
    row["decode"] = dec
    return row


def flash_attn_of(value) -> int | None:
    """llama-bench's flash_attn field (1 / 0, true / false, or "on" / "off" / "enabled" by version) as 1 / 0."""
    text = str(value).strip().lower()
    return 1 if text in ("1", "true", "on", "enabled") else 0 if text in ("0", "false", "off", "disabled") else None


def llamacpp_round(args) -> dict[str, dict]:
    """One round of llama.cpp's llama-bench on --gguf: decode at each depth (0 without --depths) and prefill at
    each prompt length, flash attention on and off; a row per setting (LLAMACPP_ROWS), shaped as ours are."""
    base = [args.llama_bench, "-m", str(args.gguf), "-r", "1", "-fa", "on,off", "-o", "jsonl"]
    base += ["-t", str(args.threads)] if args.threads else []
    depths = args.depths or (0,)
    calls = [base + ["-p", "0", "-n", str(args.decode_tokens), "-d", ",".join(map(str, depths))]]
    if args.prefills:
        calls.append(base + ["-p", ",".join(map(str, args.prefills)), "-n", "0"])
    results = [measured(c, args.cap_bytes) for c in calls]
    failed = next((r for r in results if r["rc"] != 0), None)
    lines = [json.loads(ln) for r in results if r["rc"] == 0 for ln in r["stdout"].splitlines()
             if ln.strip().startswith("{")]
    rows = {}
    for fa, name in LLAMACPP_ROWS.items():
        mine = [ln for ln in lines if flash_attn_of(ln.get("flash_attn")) == fa]
        dec = {"rc": 0, "error": None, "wall_s": round(sum(r["wall_s"] for r in results), 2),
               "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results)}      # both settings' process
        decode = {str(ln["n_depth"]): {"tokens_per_s": ln["avg_ts"], "steps": ln["n_gen"]} for ln in mine if ln["n_gen"]}
        if failed is not None:
            dec.update(rc=failed["rc"] or -1, error=f"llama-bench: {failed['error']}")
        elif not decode or str(depths[0]) not in decode:
            dec.update(rc=-1, error=f"llama-bench printed no decode result with flash attention {'on' if fa else 'off'} "
                                    f"at depth {depths[0]}")
        else:
            dec.update(tokens_per_s=decode[str(depths[0])]["tokens_per_s"], steps=args.decode_tokens)
            if args.depths:
                dec["depths"] = decode
            if args.prefills:
                dec["prefills"] = {str(ln["n_prompt"]): {"tokens_per_s": ln["avg_ts"]} for ln in mine
                                   if ln["n_prompt"] and not ln["n_gen"]}
        rows[name] = {"rc": 0, "peer": "llama-bench", "wall_s": None, "peak_rss_bytes": None, "error": None,
                      "output_bytes": os.path.getsize(args.gguf), "graph": Path(args.gguf).name, "decode": dec}
    return rows


def ratios_to_llamacpp(shape: dict) -> dict:
    """Per option of ours, decode at each depth and prefill at each length divided by the faster of llama.cpp's two
    settings in the same round: {option: {"depths" | "prefills": {point: spread}}} ({} without the peer)."""
    faster: dict = {}                  # round -> key -> point -> the faster llama.cpp tokens/s
    for name in LLAMACPP_ROWS.values():
        for run in shape["options"].get(name, {}).get("runs", []):
            dec = run.get("decode", {})
            for key in ("depths", "prefills") if dec.get("rc") == 0 else ():
                for k, v in dec.get(key, {}).items():
                    slot = faster.setdefault(run["round"], {}).setdefault(key, {})
                    slot[k] = max(slot.get(k, 0.0), v["tokens_per_s"])
    out = {}
    for name, o in shape["options"].items():
        if name in LLAMACPP_ROWS.values() or not faster:
            continue
        for key in ("depths", "prefills"):
            per_point: dict = {}
            for run in o["runs"]:
                dec = run.get("decode", {})
                for k, v in (dec.get(key, {}).items() if dec.get("rc") == 0 else ()):
                    peer = faster.get(run["round"], {}).get(key, {}).get(k)
                    if peer:
                        per_point.setdefault(k, []).append(v["tokens_per_s"] / peer)
            if per_point:
                out.setdefault(name, {})[key] = {k: stats.Spread.of(r).as_dict() for k, r in
                                                 sorted(per_point.items(), key=lambda kv: int(kv[0]))}
    return out


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["rc"] == 0]
    dec = [r["decode"] for r in ok if r.get("decode", {}).get("rc") == 0]

    def spread(values):
        values = list(values)
        return stats.Spread.of(values).as_dict() if values else None
    built = [r for r in ok if r["wall_s"] is not None]     # not a reused build, not llama-bench's row
    out = {"rounds": len(runs), "failed": len(runs) - len(ok), "wall_s": spread(r["wall_s"] for r in built),
           "peak_rss_gb": spread(r["peak_rss_bytes"] / GB for r in built),
           "output_gb": spread(r["output_bytes"] / GB for r in ok),
           "decode_tokens_per_s": spread(d["tokens_per_s"] for d in dec),
           "decode_peak_rss_gb": spread(d["peak_rss_bytes"] / GB for d in dec)}
    for key, out_key in (("depths", "depth_decode_tokens_per_s"), ("prefills", "prefill_tokens_per_s")):
        points = sorted({int(k) for d in dec for k in d.get(key, {})})
        if points:
            out[out_key] = {str(k): spread(d[key][str(k)]["tokens_per_s"] for d in dec if str(k) in d.get(key, {}))
                            for k in points}
    return out


def table(shape: dict) -> str:

    def f(s: dict, digits: int) -> str:
        if s is None:
            return "-"
        return " / ".join(f"{s[k]:.{digits}f}" if digits else f"{s[k]:.3g}" for k in ("min", "median", "max"))
    head = ["option", "ok / rounds", "build s", "build peak GB", "output GB", "decode tok/s", "decode peak GB"]
    lines = [f"{shape['name']}: {human(shape['params'])} parameters, folder {human(shape['folder_bytes'], 'B')} "
             "(min / median / max over rounds)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, o in shape["options"].items():
        s = o["summary"]
        lines.append(f"| {name} | {s['rounds'] - s['failed']} / {s['rounds']} | {f(s['wall_s'], 1)} | "
                     f"{f(s['peak_rss_gb'], 0)} | {f(s['output_gb'], 0)} | {f(s['decode_tokens_per_s'], 1)} | "
                     f"{f(s['decode_peak_rss_gb'], 0)} |")
    for key, what in (("depth_decode_tokens_per_s", "decode tok/s at depth"), ("prefill_tokens_per_s",
                                                                              "prefill tok/s at prompt length")):
        points = sorted({int(k) for o in shape["options"].values() for k in o["summary"].get(key, {})})
        if points:
            lines += ["", f"| option | " + " | ".join(f"{what} {k}" for k in points) + " |", "|" + "---|" * (len(points) + 1)]
            lines += [f"| {name} | " + " | ".join(f(o["summary"].get(key, {}).get(str(k)), 1) for k in points) + " |"
                      for name, o in shape["options"].items()]
    for key, what in (("depths", "decode at depth"), ("prefills", "prefill at")):
        ratios = {name: r[key] for name, r in shape.get("ratios_to_llamacpp", {}).items() if key in r}
        points = sorted({int(k) for r in ratios.values() for k in r})
        if points:
            lines += ["", "| option / llama.cpp's faster setting, per round: median [min, max] | " +
                      " | ".join(f"{what} {k}" for k in points) + " |", "|" + "---|" * (len(points) + 1)]
            lines += [f"| {name} | " + " | ".join(
                      (f"{sp['median']:.2f}x [{sp['min']:.2f}, {sp['max']:.2f}]" if (sp := r.get(str(k))) else "-")
                      for k in points) + " |" for name, r in ratios.items()]
    lines += [f"  {name} round {r['round']}: {err}" for name, o in shape["options"].items() for r in o["runs"]
              if (err := r.get("error") or r.get("decode", {}).get("error") or r.get("decode", {}).get("skipped"))]
    lines += [f"  peer {k}: {v}" for k, v in shape["peers"].items() if isinstance(v, str)]
    return "\n".join(lines)


def work_folder(work: Path, shape: str, option: str) -> Path:
    """Where a shape's build of `option` goes (GENAI: the peer's; "genai-input": the peer's input)."""
    if option == "genai-input":
        return work / f"genai-input-{shape}"
    return work / (f"genai-{shape}-int4" if option == GENAI else f"build-{shape}-{option}")


def check_work(work: Path, shapes: list[str], options, genai: bool) -> None:
    """Every folder and file a run writes, checked before it writes the first (one line, not a failed round hours in)."""
    for shape in shapes:
        builds = {work_folder(work, shape, o): BUILD for o in options}
        if genai:
            builds[work_folder(work, shape, GENAI)] = BENCH_CACHE
        for folder, kind in {work / shape: SCALE_FOLDER, **builds, **({work_folder(work, shape, "genai-input"):
                                                                       SCALE_FOLDER} if genai else {})}.items():
            check_output_dir(folder, kind, option="--work")
        for folder in builds if work.is_dir() else ():      # (a new work folder holds none)
            check_output_file(build_record(folder), REPORT_JSON)


def bench_shape(spec: str, options: dict[str, list[str]], args, log=print) -> dict:
    name, config = resolve_shape(spec)
    config = folder_config(config, layers=args.layers)
    folder = args.work / name
    if folder_matches(folder, spec, layers=args.layers):
        log(f"{name}: reusing {folder}")
    else:
        write_random_folder(spec, folder, layers=args.layers, log=log)
    shape = {"name": name, "config": config, "folder": str(folder), "folder_bytes": folder_bytes(folder),
             "params": sum(math.prod(s) for _, s, _ in tensor_specs(config)),
             "options": {n: {"build_args": a, "runs": []} for n, a in options.items()}, "peers": {}}
    genai_in = None
    if "genai" in args.peers:
        if importlib.util.find_spec("onnxruntime_genai") is None:
            shape["peers"]["genai"] = "skipped: onnxruntime-genai not installed"
        else:
            genai_in = genai_input(folder, work_folder(args.work, name, "genai-input"))
            shape["options"][GENAI] = {"build_args": ["bench.genai_builder", "-p", "int4", "-e", "cpu"],
                                       "runs": []}
            shape["peers"]["genai"] = {"option": GENAI, "input": str(genai_in)}
    slots = list(shape["options"])
    if "llamacpp" in args.peers:
        shape["options"].update({n: {"build_args": ["llama-bench", "-m", str(args.gguf), "-fa", "on,off"], "runs": []}
                                 for n in LLAMACPP_ROWS.values()})
        shape["peers"]["llamacpp"] = {"options": list(LLAMACPP_ROWS.values()), "gguf": str(args.gguf),
                                      "llama_bench": args.llama_bench}
        slots.append(LLAMACPP)
    for r in range(args.rounds):
        for slot in stats.round_order(slots, r):
            if slot == LLAMACPP:
                rows = llamacpp_round(args)
            else:
                out = work_folder(args.work, name, slot)
                rows = {slot: measure_option(slot, shape["options"][slot]["build_args"], folder, out, args, genai_in)}
            for opt, row in rows.items():
                row["round"] = r + 1
                shape["options"][opt]["runs"].append(row)
                log(f"  {name} {opt} round {r + 1}: {row_line(row)}", flush=True)
    for o in shape["options"].values():
        o["summary"] = summarize(o["runs"])
    shape["ratios_to_llamacpp"] = ratios_to_llamacpp(shape)
    return shape


def row_line(row: dict) -> str:
    """One round of one option, for the log."""
    dec = row.get("decode", {})
    if row["rc"] != 0:
        head = f"build failed: {row['error']}"
    elif row.get("reused"):
        head = f"build reused (an earlier run's, same arguments), output {human(row['output_bytes'], 'B')}; "
    elif row.get("peer"):
        head = f"{row['peer']} on {row['graph']}; "
    else:
        head = (f"build {row['wall_s']:.1f} s, peak {human(row['peak_rss_bytes'], 'B')}, "
                f"output {human(row['output_bytes'], 'B')}; ")
    if dec.get("rc") == 0:
        return head + f"decode {dec['tokens_per_s']:.1f} tok/s, peak {human(dec['peak_rss_bytes'], 'B')}"
    return head + (f"decode skipped: {dec['skipped']}" if "skipped" in dec else
                   f"decode failed: {dec['error']}" if dec else "")


def check_llamacpp(args, specs: list[str]) -> None:
    """--peers llamacpp needs one shape, its --gguf and a llama-bench to run; --gguf alone is a mistake."""
    import shutil
    if "llamacpp" not in args.peers:
        if args.gguf is not None:
            raise UsageError("--gguf: expected --peers llamacpp too (the GGUF is llama.cpp's); add it, or drop --gguf")
        return
    if len(specs) != 1:
        raise UsageError(f"--peers llamacpp: expected one shape (--gguf is one shape's model), found {len(specs)}; "
                         "run one shape at a time")
    if args.gguf is None or not args.gguf.is_file():
        error = UsageError if args.gguf is None else UserError
        raise error(f"{args.gguf or '--peers llamacpp'}: expected llama.cpp's GGUF of the shape's folder, found "
                    f"{'no --gguf' if args.gguf is None else 'no file'}; make it with python -m bench.llamacpp gguf "
                    f"--checkpoint {args.work / resolve_shape(specs[0])[0]} ... and pass --gguf OUT/model-q4_0.gguf")
    found = shutil.which(args.llama_bench)
    if found is None:
        raise UserError(f"{args.llama_bench}: expected llama.cpp's llama-bench (an executable), found none; "
                        "build llama.cpp and pass --llama-bench PATH")
    args.llama_bench = found


def run_bench(args) -> int:
    import platform
    from bench.runners import machine_info
    options = parse_options(args.options or "") if args.options is not None or not args.peers else {}
    specs = [s.strip() for s in args.shapes.split(",") if s.strip()]
    names = [resolve_shape(s)[0] for s in specs]            # one error line before any work
    if not specs or len(set(names)) < len(names):
        raise UsageError(f"--shapes {args.shapes!r}: expected distinct shapes, found "
                         f"{'none' if not specs else 'one twice'}; list each once")
    args.peers = [p for p in args.peers.split(",") if p]
    if any(p not in PEERS for p in args.peers):
        raise UsageError(f"--peers {','.join(args.peers)}: expected {', '.join(PEERS)}; drop the others")
    check_llamacpp(args, specs)
    if args.work.exists() and not args.work.is_dir():
        raise UserError(f"{args.work}: expected a work directory, found a file; choose another --work")
    check_output_file(args.json, REPORT_JSON)
    check_work(args.work, names, options, "genai" in args.peers and importlib.util.find_spec("onnxruntime_genai"))
    args.work.mkdir(parents=True, exist_ok=True)
    from core.inputs import available_memory
    avail = available_memory()
    args.cap_bytes = int(args.memory_cap * GB) if args.memory_cap is not None else \
        (max(avail - 2**30, 0) if avail is not None else 0)
    import onnxruntime
    report = {"command": "python -m bench.scale " + shlex.join(args.argv),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": machine_info(gpu=False),
              "versions": {"onnxruntime": onnxruntime.__version__, "python": platform.python_version()},
              "rounds": args.rounds, "decode_tokens": args.decode_tokens, "prompt_tokens": args.prompt_tokens,
              "threads": args.threads, "memory_cap_bytes": args.cap_bytes, "depths": list(args.depths),
              "prefills": list(args.prefills), "shapes": []}
    for spec in specs:
        report["shapes"].append(bench_shape(spec, options, args))
        write_json(args.json, report)               # after every shape: an interrupted run keeps the finished ones
        print(table(report["shapes"][-1]), flush=True)
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


# --- plot ----------------------------------------------------------------------------------------

PLOTTED = (("peak_rss_gb", "build peak resident GB"), ("wall_s", "build wall s"),
           ("decode_tokens_per_s", "decode tokens/s (batch 1)"))


CURVES = (("depth_decode_tokens_per_s", ("decode tokens/s against depth", "tokens in the cache")),
          ("prefill_tokens_per_s", ("prefill tokens/s against prompt length", "prompt tokens")))


OURS_COLOURS = ("tab:blue", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan", "tab:red")


def _style(label: str, ours_index: int) -> dict:
    """A row's colour (and line style) in every panel: GenAI's builder orange, llama.cpp green (flash attention
    off dashed), ours the other colours in turn, so that the title's key holds for the curves as for the bars."""
    if GENAI in label:
        return {"color": "tab:orange"}
    if LLAMACPP in label:
        return {"color": "tab:green", "linestyle": "--" if label.endswith("-off") else "-"}
    return {"color": OURS_COLOURS[ours_index % len(OURS_COLOURS)]}


def plot(reports: list[dict], out: Path) -> Path:
    """One bar per (shape, option) of the reports, median with its min-max, for build peak memory,
    build time and decode speed; a bar is missing where that row has no number (bf16 decode)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [(f"{sh['name']}\n{name}", o["summary"]) for r in reports for sh in r["shapes"]
            for name, o in sh["options"].items()]
    curves = [key for key, _ in CURVES if any(key in s for _, s in rows)]
    ours = [label for label, _ in rows if GENAI not in label and LLAMACPP not in label]
    styles = {label: _style(label, ours.index(label) if label in ours else 0) for label, _ in rows}
    fig, axes = plt.subplots(1, len(PLOTTED) + len(curves), figsize=(4.2 * (len(PLOTTED) + len(curves)),
                                                                     0.45 * len(rows) + 1.6))
    for ax, key in zip(axes[len(PLOTTED):], curves):       # tokens/s against depth or prompt length
        for label, s in rows:
            points = sorted((int(k), sp) for k, sp in s.get(key, {}).items() if sp)
            if points:
                x, med = [k for k, _ in points], [sp["median"] for _, sp in points]
                err = [[sp["median"] - sp["min"] for _, sp in points], [sp["max"] - sp["median"] for _, sp in points]]
                ax.errorbar(x, med, yerr=err, capsize=3, marker="o", label=label.replace("\n", " "), **styles[label])
        ax.set_xlabel(dict(CURVES)[key][1], fontsize=8)
        ax.set_title(dict(CURVES)[key][0], fontsize=9)
        ax.legend(fontsize=6)
    for ax, (key, title) in zip(axes, PLOTTED):
        spreads = [s.get(key) for _, s in rows]
        y = list(range(len(rows)))
        med = [sp["median"] if sp else 0 for sp in spreads]
        err = [[sp["median"] - sp["min"] if sp else 0 for sp in spreads], [sp["max"] - sp["median"] if sp else 0
                                                                          for sp in spreads]]
        ax.barh(y, med, xerr=err, capsize=3, color=[styles[label]["color"] for label, _ in rows])
        ax.set_yticks(y, [label for label, _ in rows] if ax is axes[0] else [""] * len(rows), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    starts = ", ".join(sorted({r["started"][:16] for r in reports}))
    fig.suptitle(f"bench.scale (median, min-max over rounds; orange: ONNX Runtime GenAI's builder, green: llama.cpp, "
                 "dashed: its flash attention off), "
                 f"{starts}", fontsize=8)
    fig.tight_layout()
    with output_file(out, FIGURE) as tmp:
        fig.savefig(tmp, dpi=110, format="png", metadata=png_signature_metadata())
    plt.close(fig)
    return out


def _counts(lo: int):
    """argparse type of --depths (lo 0) / --prefills (lo 1): a comma list of token counts in [lo, 2^20]."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values or any(v < lo or v > 1 << 20 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of token counts in [{lo}, {1 << 20}], "
                                             f"found {'none' if not values else 'one outside'}; e.g. {lo},1024,4096")
        return values
    parse.__name__ = "a list of token counts"          # argparse names the type in its message
    return parse


def run(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write a random-init Hugging Face folder of a real shape")
    mk.add_argument("shape", help="a name from bench/shapes.py or a config .json path")
    mk.add_argument("--out", type=Path, required=True, help="the folder to write (new, or an earlier one of ours)")
    mk.add_argument("--layers", type=int_in(1, 1024), default=None, help="override the layer count")
    mk.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0)
    mk.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    mk.add_argument("--shard-gb", type=float_in(1e-6), default=2 * 2**30 / GB, help="shard size in GB (default 2 GiB)")
    rn = sub.add_parser("run", help="build and decode each shape with each option set, interleaved rounds")
    rn.add_argument("--shapes", required=True, help="comma list of shape names or config .json paths")
    rn.add_argument("--work", type=Path, required=True, help="folders and builds go here (reused when present)")
    rn.add_argument("--options", default=None, help='"NAME=EXPORT.BUILD ARGS;..." e.g. "int4=--fuse --quantize int4" '
                    "(required unless --peers is given: then the peers alone may run)")
    rn.add_argument("--rounds", type=int_in(1, 100), default=1)
    rn.add_argument("--decode-tokens", type=int_in(1, 1024), default=64)
    rn.add_argument("--prompt-tokens", type=int_in(1, 1024), default=16)
    rn.add_argument("--threads", type=int_in(0, 1024), default=2, help="decode intra-op threads (0: ONNX Runtime's choice)")
    rn.add_argument("--layers", type=int_in(1, 1024), default=None, help="override every shape's layer count")
    rn.add_argument("--peers", default="", help="genai: also ONNX Runtime GenAI's builder, int4 (when installed); "
                    "llamacpp: also llama.cpp's llama-bench on --gguf, flash attention on and off")
    rn.add_argument("--gguf", type=Path, default=None, help="--peers llamacpp: llama.cpp's GGUF of the shape's folder "
                    "(python -m bench.llamacpp gguf)")
    rn.add_argument("--llama-bench", default="llama-bench", help="--peers llamacpp: llama.cpp's llama-bench "
                    "(default: the one on PATH)")
    rn.add_argument("--reuse-builds", action="store_true", help="decode a build an earlier run wrote with the same "
                    "arguments instead of building it again (no build figures for it)")
    rn.add_argument("--depths", type=_counts(0), default=(), metavar="N,N,...",
                    help="also decode tokens/s after a prefill of each N tokens (e.g. 0,1024,4096,8192)")
    rn.add_argument("--prefills", type=_counts(1), default=(), metavar="N,N,...",
                    help="also prefill tokens/s (time to first token) of prompts of each N tokens (e.g. 128,1024,4096)")
    rn.add_argument("--memory-cap", type=float_in(0.1), default=None, metavar="GB",
                    help="stop any command whose process tree passes GB resident (default: the memory available "
                         "at the start less 1 GiB), so that no peer meets the kernel's OOM killer")
    rn.add_argument("--json", type=Path, required=True, help="where the numbers go (a JSON report)")
    dc = sub.add_parser("decode", help="(the child `run` measures) decode speed of one graph, one JSON line")
    dc.add_argument("model", help="an .onnx graph, or with --genai a GenAI build folder")
    dc.add_argument("--genai", action="store_true")
    dc.add_argument("--decode-tokens", type=positive_int, default=64)
    dc.add_argument("--prompt-tokens", type=positive_int, default=16)
    dc.add_argument("--threads", type=int_in(0, 1024), default=2)
    dc.add_argument("--depths", type=_counts(0), default=())
    dc.add_argument("--prefills", type=_counts(1), default=())
    dr = sub.add_parser("drift", help="two graphs of one model: logits drift and greedy agreement, one JSON line")
    dr.add_argument("reference", help="the reference .onnx graph (e.g. the fp32-cache build's)")
    dr.add_argument("other", help="the .onnx graph compared with it (e.g. the --kv-cache fp16 build's)")
    dr.add_argument("--prompt-tokens", type=positive_int, default=2048)
    dr.add_argument("--new-tokens", type=positive_int, default=256)
    dr.add_argument("--threads", type=int_in(0, 1024), default=2)
    pl = sub.add_parser("plot", help="a figure of one or more run reports (--json files)")
    pl.add_argument("reports", nargs="+", type=Path, help="bench.scale run --json files")
    pl.add_argument("--out", type=Path, required=True, help="the .png to write")
    args = p.parse_args(argv)
    args.argv = argv
    if args.command == "plot":
        from core.inputs import read_json_file
        print(f"wrote {plot([read_json_file(r, 'a bench.scale report') for r in args.reports], args.out)}")
        return 0
    if args.command == "make":
        out = write_random_folder(args.shape, args.out, seed=args.seed, dtype=args.dtype,
                                  shard_bytes=max(1, int(args.shard_gb * GB)), layers=args.layers)
        print(f"wrote {out}: {human(folder_bytes(out), 'B')}")
        return 0
    if args.command == "drift":
        print(json.dumps(graph_drift(args.reference, args.other, args.prompt_tokens, args.new_tokens, args.threads)))
        return 0
    if args.command == "decode":
        print(json.dumps(decode_speed(args.model, args.decode_tokens, args.prompt_tokens, args.threads, args.genai,
                                      args.depths, args.prefills)))
        return 0
    return run_bench(args)


def main(argv=None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
