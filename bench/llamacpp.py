"""python -m bench.llamacpp gguf --checkpoint DIR --source SDIST (--llamacpp-python PY | --quantize-bin BIN) --out DIR
                             [--vocab llama-bpe]
python -m bench.llamacpp ours-folder --checkpoint DIR --source SDIST --out DIR [--vocab llama-bpe]
python -m bench.llamacpp serve --gguf FILE --llamacpp-python PY [--server-bin BIN] --slots N --threads N [--port P]
                               [--block-amx]
python -m bench.llamacpp compare --ours-url http://127.0.0.1:PORT --gguf FILE --llamacpp-python PY --threads N
                                 [--block-amx] [--concurrency 1,4,16] [--rounds N] [--max-new-tokens N] --out DIR

llama.cpp's server as the peer of ours, on the same random-init folder (`python -m bench.scale make`):

gguf     the folder as llama.cpp's Q4_0 GGUF, in two steps, each in a child process:
         1. llama.cpp's own convert_hf_to_gguf.py (from llama-cpp-python's source package, --source: the
            .tar.gz or its unpacked folder; it vendors llama.cpp with the script, its `conversion` package
            and `gguf-py`) writes an f16 GGUF, run by this python (it needs torch and transformers). A
            random folder has no tokenizer, so the converter's set_vocab is replaced by a copy of the
            `tokenizer.*` keys of a vocab-only GGUF that llama.cpp ships for its tests
            (vendor/llama.cpp/models/ggml-vocab-<--vocab>.gguf; llama-bpe is Llama 3's 128256 tokens, so
            a Llama-3.2-shaped folder matches it, qwen2 Qwen's 151936, a Qwen3-shaped one; a folder whose
            vocab_size differs is refused);
         2. llama.cpp's quantizer (`llama_cpp.llama_model_quantize`, LLAMA_FTYPE_MOSTLY_Q4_0), run by
            --llamacpp-python, writes OUT/model-q4_0.gguf; or, with --quantize-bin, llama.cpp's own
            `llama-quantize` binary (built with llama-server: no llama-cpp-python needed), the same
            llama_model_quantize behind its command line. The f16 file is dropped.
ours-folder  the same folder for ours (its files linked) with the same vocabulary as tokenizer.json: Llama 3's
         byte-level BPE rebuilt from the vocab-only GGUF's tokens and merges with Llama 3's pre-tokenizer split
         (the regex llama.cpp's llama-vocab.cpp quotes from Llama 3's tokenizer.json) and its <|begin_of_text|>
         prefix, so both servers see prompts of the same tokens (it tokenizes llama.cpp's own test strings,
         models/ggml-vocab-llama-bpe.gguf.inp, to exactly the ids of .out: tests/bench/test_llamacpp.py).
serve    starts llama.cpp's server on that GGUF on 127.0.0.1 and waits until it answers /v1/models:
         `python -m llama_cpp.server` (llama-cpp-python) or, with --server-bin, llama.cpp's own
         `llama-server` with --parallel = --slots and continuous batching. Threads: --threads for both
         decode and prompt (n_threads, n_threads_batch), the same as ours' intra-op threads.
         --block-amx: for a CPU that advertises AMX whose tile instructions fault (block_amx below).
compare  the interleaved comparison: in each round, for each concurrency level (order rotated each round,
         bench.stats.round_order), ours and llama.cpp one after the other (which goes first alternates),
         each level a bench.serve level of the same client (bench/openai_client.py: streamed
         /v1/completions, greedy, exactly --max-new-tokens); llama.cpp's server is started for each
         level with slots = the level's concurrency and stopped after it, so it holds no CPU while ours
         runs. Ours is a server already running (runtime.triton serve --openai-port), its slots at least
         the largest level. OUT/results.json and OUT/results.md: per server and level tok/s (pooled, and
         min / median / max over rounds), TTFT and inter-token p50 / p90 / p99, errors; per level the
         per-round ratio ours / llama.cpp of tok/s and both TTFT p99.

What llama-cpp-python's server is (0.3.x, llama_cpp/server/app.py): ONE llama_context behind a lock; it
runs one request at a time, has no parallel slots (no n_parallel setting; --slots only sizes llama-server),
and by default (`interrupt_requests`) ends a streaming request when another one arrives — `serve` starts it
with `--interrupt_requests False`, so concurrent requests queue instead. It takes `min_tokens`, not
`ignore_eos` (the client sends min_tokens to it: --force-length), and streams no `usage` (its tokens are
counted as max_tokens from finish_reason "length"; bench/openai_client.py).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import stats
from core.errors import ArgumentParser, UsageError, UserError, int_in
from core.lifecycle import run_cli
from core.outputs import OutputKind, SERVE_RESULTS, check_output_dir, claim_dir, output_dir, replace_file_in

LLAMACPP_GGUF = OutputKind("llamacpp-gguf", "a llama.cpp GGUF folder", "python -m bench.llamacpp gguf")
GGUF_NAME = "model-q4_0.gguf"
VENDOR = "vendor/llama.cpp"
# what the converter needs of the source package (a few MB of its 75)
SOURCE_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-")
LLAMA_FTYPE_MOSTLY_Q4_0 = 2     # llama.h enum llama_ftype
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0

# Run by this python: llama.cpp's converter with its set_vocab replaced (module docstring).
# argv: SOURCE VOCAB_GGUF FOLDER OUTFILE
_CONVERT = r"""
import json, sys
from pathlib import Path
src, vocab, folder, outfile = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
sys.path[:0] = [str(src), str(src / "gguf-py")]
import gguf
reader = gguf.GGUFReader(vocab)
fields = {f.name: f for f in reader.fields.values() if f.name.startswith("tokenizer.")}
n_vocab = len(fields["tokenizer.ggml.tokens"].contents())
config = json.loads((folder / "config.json").read_text())
if config.get("vocab_size") != n_vocab:
    sys.exit(f"error: {folder}: expected vocab_size {n_vocab} (the tokens of {Path(vocab).name}), found "
             f"{config.get('vocab_size')}; pick the matching --vocab")

def set_vocab_from_gguf(self):
    for name, f in fields.items():
        self.gguf_writer.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[1] if len(f.types) > 1 else None)

import conversion.base, conversion.llama, conversion.qwen
for cls in (conversion.base.TextModel, conversion.llama.LlamaModel, conversion.qwen.Qwen2Model,
            conversion.qwen.Qwen3Model):        # the families' own set_vocab read a tokenizer the folder lacks
    cls.set_vocab = set_vocab_from_gguf
sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", "f16", "--outfile", outfile]
import runpy
runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")
"""

# Run by --llamacpp-python: llama.cpp's quantizer. argv: IN OUT FTYPE THREADS
_QUANTIZE = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(f"error: llama_model_quantize returned {rc}" if rc else 0)
"""


# --block-amx: llama.cpp's AMX check (ggml-cpu/amx/amx.cpp ggml_amx_init: arch_prctl(ARCH_REQ_XCOMP_PERM,
# XTILEDATA)) made to fail by a seccomp filter installed in the server's process before it starts (EPERM
# for that one call on x86-64; the filter survives exec), so llama.cpp takes its own fallback for a CPU
# without AMX (its AVX-512 / AVX2 kernels over repacked Q4_0 weights, the CPU_REPACK buffer) and says
# "AMX is not ready to be used!". For a machine that advertises AMX in cpuid where the tile instructions
# still fault: on this project's VMs (Firecracker) a llama.cpp built with GGML_NATIVE dies with SIGILL at
# `tilezero` in ggml_backend_amx_mul_mat on its first request (gdb).
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
AUDIT_ARCH_X86_64, NR_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM = 0xC000003E, 158, 0x1023
SECCOMP_RET_ERRNO_EPERM, SECCOMP_RET_ALLOW = 0x00050000 | 1, 0x7FFF0000


def block_amx() -> None:
    """Install the seccomp filter above in this process (a Popen preexec_fn); OSError where it cannot be."""
    import ctypes
    import struct

    def ins(code, jt, jf, k):       # struct sock_filter
        return struct.pack("=HBBI", code, jt, jf, k)
    ld, jeq, ret = 0x20, 0x15, 0x06      # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    prog = b"".join([ins(ld, 0, 0, 4), ins(jeq, 0, 5, AUDIT_ARCH_X86_64),       # seccomp_data.arch
                     ins(ld, 0, 0, 0), ins(jeq, 0, 3, NR_ARCH_PRCTL),           # .nr
                     ins(ld, 0, 0, 16), ins(jeq, 0, 1, ARCH_REQ_XCOMP_PERM),    # .args[0] (low word)
                     ins(ret, 0, 0, SECCOMP_RET_ERRNO_EPERM), ins(ret, 0, 0, SECCOMP_RET_ALLOW)])
    buf = ctypes.create_string_buffer(prog, len(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER,
                                                                 ctypes.byref(fprog), 0, 0):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# --- the GGUF ----------------------------------------------------------------------------------------

def source_dir(source: str | os.PathLike, work: Path) -> Path:
    """llama.cpp's folder (the one with convert_hf_to_gguf.py) in llama-cpp-python's source package:
    an unpacked folder is used as it is; a .tar.gz has the converter's files unpacked under `work`."""
    source = Path(source)
    if source.is_dir():
        for d in (source, source / VENDOR):
            if (d / "convert_hf_to_gguf.py").is_file():
                return d
        raise UserError(f"--source {source}: expected llama-cpp-python's source folder (with {VENDOR}/"
                        "convert_hf_to_gguf.py), found none; pass the unpacked source package or its .tar.gz")
    if not source.is_file() or not tarfile.is_tarfile(source):
        raise UserError(f"--source {source}: expected llama-cpp-python's source package (.tar.gz, `pip download "
                        "--no-binary :all: --no-deps llama-cpp-python`) or its unpacked folder, found "
                        f"{'no such file' if not source.exists() else 'another file'}; pass it")
    with tarfile.open(source) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and _wanted(m.name)]
        if not members:
            raise UserError(f"--source {source}: expected {VENDOR}/convert_hf_to_gguf.py inside, found none; "
                            "pass llama-cpp-python's source package")
        tar.extractall(work, members=members, filter="data")
    root = members[0].name.split("/")[0]
    return work / root / VENDOR


def _wanted(name: str) -> bool:
    parts = name.split("/", 1)
    return len(parts) == 2 and parts[1].startswith(VENDOR + "/") and \
        parts[1][len(VENDOR) + 1:].startswith(SOURCE_MEMBERS)


def make_gguf(folder: str | os.PathLike, out: str | os.PathLike, *, source: str | os.PathLike,
              python: str | None = None, quantize_bin: str | None = None, vocab: str = "llama-bpe",
              threads: int | None = None, log=print) -> Path:
    """OUT/model-q4_0.gguf from a random-init Llama folder (module docstring); returns the GGUF's path.
    The quantizer: llama-cpp-python's, run by `python`, or the `quantize_bin` binary (exactly one)."""
    if (python is None) == (quantize_bin is None):
        raise UsageError("gguf: expected one quantizer, --llamacpp-python or --quantize-bin, found "
                         f"{'both' if python else 'neither'}; pass one of them")
    if quantize_bin is not None and not (Path(quantize_bin).is_file() and os.access(quantize_bin, os.X_OK)):
        raise UserError(f"--quantize-bin {quantize_bin}: expected llama.cpp's llama-quantize executable, found "
                        "no such executable file; build llama.cpp (cmake --build BUILD --target llama-quantize)")
    folder, out = Path(folder), Path(out)
    if not (folder / "config.json").is_file():
        raise UserError(f"--checkpoint {folder}: expected a Hugging Face folder (config.json), found none; "
                        "make one with `python -m bench.scale make llama-3.2-1b --out DIR`")
    check_output_dir(out, LLAMACPP_GGUF, inputs=[folder])
    with output_dir(out, LLAMACPP_GGUF, inputs=[folder],
                    marker={"checkpoint": str(folder.resolve()), "vocab": vocab, "type": "q4_0"}) as tmp, \
            tempfile.TemporaryDirectory(prefix="llamacpp-src-") as work:
        src = source_dir(source, Path(work))
        vocab_file = _vocab_file(src, vocab)
        f16 = tmp / "model-f16.gguf"
        log(f"convert {folder} -> f16 GGUF (llama.cpp's convert_hf_to_gguf.py, vocabulary of {vocab_file.name})")
        _child([sys.executable, "-c", _CONVERT, str(src), str(vocab_file), str(folder), str(f16)], "convert_hf_to_gguf")
        nthread = str(threads or os.cpu_count() or 1)
        if quantize_bin is not None:
            log(f"quantize -> Q4_0 ({quantize_bin})")
            _child([quantize_bin, str(f16), str(tmp / GGUF_NAME), "Q4_0", nthread], "llama-quantize")
        else:
            log(f"quantize -> Q4_0 ({python}: llama_cpp.llama_model_quantize)")
            _child([python, "-c", _QUANTIZE, str(f16), str(tmp / GGUF_NAME), str(LLAMA_FTYPE_MOSTLY_Q4_0), nthread],
                   "llama_model_quantize")
        f16.unlink()
    log(f"wrote {out / GGUF_NAME}")
    return out / GGUF_NAME


def _child(cmd: list[str], what: str) -> None:
    """Run a child; its failure is one line: its own `error:` line, else its last line."""
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    if r.returncode != 0:
        lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
        mine = [ln for ln in lines if ln.startswith("error: ")]
        last = mine[-1][len("error: "):] if mine else (lines[-1] if lines else f"exit code {r.returncode}")
        raise UserError(f"{what}: expected success, found {last}; see {shlex.join(cmd[:1] + ['...'])}")


# --- the same vocabulary for ours ----------------------------------------------------------------------

# Llama 3's pre-tokenizer split, as in its tokenizer.json (llama.cpp's src/llama-vocab.cpp quotes it)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_TOKEN_CONTROL = 3      # gguf-py TokenType.CONTROL: <|begin_of_text|>, <|eot_id|>, the reserved ones


def gguf_vocab(src: Path, vocab_file: Path) -> dict:
    """The tokenizer.* fields of a vocab-only GGUF, read with the source package's own gguf-py."""
    sys.path.insert(0, str(src / "gguf-py"))
    try:
        import gguf
        reader = gguf.GGUFReader(str(vocab_file))
        return {f.name: f.contents() for f in reader.fields.values() if f.name.startswith("tokenizer.")}
    finally:
        sys.path.remove(str(src / "gguf-py"))


def llama3_tokenizer(fields: dict, what: str):
    """A tokenizers.Tokenizer equal to llama.cpp's llama-bpe tokenization (module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    kind = (fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre"))
    if kind != ("gpt2", "llama-bpe"):
        raise UserError(f"--vocab {what}: expected Llama 3's byte-level BPE (gpt2 / llama-bpe), found {kind[0]} / "
                        f"{kind[1]}; use --vocab llama-bpe")
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_CONTROL])
    bos = tokens[fields["tokenizer.ggml.bos_token_id"]]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, fields["tokenizer.ggml.bos_token_id"])])
    return tok


def ours_folder(folder: str | os.PathLike, out: str | os.PathLike, *, source: str | os.PathLike,
                vocab: str = "llama-bpe", log=print) -> Path:
    """The folder's files (linked) plus tokenizer.json of llama.cpp's vocabulary (module docstring)."""
    from core.outputs import SCALE_FOLDER
    folder, out = Path(folder), Path(out)
    if not (folder / "config.json").is_file():
        raise UserError(f"--checkpoint {folder}: expected a Hugging Face folder (config.json), found none; "
                        "make one with `python -m bench.scale make llama-3.2-1b --out DIR`")
    with output_dir(out, SCALE_FOLDER, inputs=[folder]) as tmp, \
            tempfile.TemporaryDirectory(prefix="llamacpp-src-") as work:
        src = source_dir(source, Path(work))
        fields = gguf_vocab(src, _vocab_file(src, vocab))
        n = len(fields["tokenizer.ggml.tokens"])
        vocab_size = json.loads((folder / "config.json").read_text()).get("vocab_size")
        if vocab_size != n:
            raise UserError(f"--checkpoint {folder}: expected vocab_size {n} (the tokens of --vocab {vocab}), "
                            f"found {vocab_size}; pick the matching --vocab")
        tok = llama3_tokenizer(fields, vocab)
        for f in folder.iterdir():
            if not f.name.startswith(".") and f.name != "tokenizer.json":
                (tmp / f.name).symlink_to(f.resolve())
        tok.save(str(tmp / "tokenizer.json"))
    log(f"wrote {out}: {folder}'s files linked, tokenizer.json of llama.cpp's {vocab} vocabulary ({n} tokens)")
    return out


def _vocab_file(src: Path, vocab: str) -> Path:
    vocab_file = src / "models" / f"ggml-vocab-{vocab}.gguf"
    if not vocab_file.is_file():
        have = sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in (src / "models").glob("ggml-vocab-*.gguf"))
        raise UserError(f"--vocab {vocab}: expected one of llama.cpp's vocab-only GGUFs ({', '.join(have)}), "
                        "found none of that name; pick one")
    return vocab_file


# --- the server --------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppServer:
    """llama.cpp's server on 127.0.0.1 for as long as `with` lasts (module docstring): started in its own
    process group, ready when /v1/models answers, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, gguf: str | os.PathLike, *, slots: int, threads: int, python: str | None = None,
                 server_bin: str | None = None, ctx_per_slot: int = 2048, port: int | None = None,
                 log: str | os.PathLike | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
                 block_amx: bool = False):
        if (python is None) == (server_bin is None):
            raise UsageError("llama.cpp's server: expected --llamacpp-python or --server-bin, found "
                             f"{'both' if python else 'neither'}; pass one")
        self.gguf, self.slots, self.threads, self.python, self.server_bin = Path(gguf), slots, threads, python, server_bin
        self.ctx_per_slot, self.port, self.log = ctx_per_slot, port or free_port(), log
        self.ready_timeout_s, self.block_amx = ready_timeout_s, block_amx
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def force_length(self) -> str:
        """The request field that makes this server generate exactly max_tokens."""
        return "min_tokens" if self.server_bin is None else "ignore_eos"

    def command(self) -> list[str]:
        t = str(self.threads)
        if self.server_bin is not None:
            return [self.server_bin, "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "--threads", t, "--threads-batch", t, "--parallel", str(self.slots),
                    "--ctx-size", str(self.ctx_per_slot * self.slots), "--cont-batching"]
        # llama-cpp-python: one sequence, no slots (module docstring)
        return [self.python, "-m", "llama_cpp.server", "--model", str(self.gguf), "--host", "127.0.0.1",
                "--port", str(self.port), "--n_threads", t, "--n_threads_batch", t, "--n_ctx", str(self.ctx_per_slot),
                "--interrupt_requests", "False"]

    def shown(self) -> str:
        """The command as a line for people, with --block-amx's filter named."""
        return shlex.join(self.command()) + (" (under --block-amx's seccomp filter)" if self.block_amx else "")

    def __enter__(self) -> "LlamaCppServer":
        if not self.gguf.is_file():
            raise UserError(f"--gguf {self.gguf}: expected a GGUF file, found none; "
                            "make it with `python -m bench.llamacpp gguf`")
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=block_amx if self.block_amx else None)
        except OSError as e:
            raise UserError(f"{self.command()[0]}: expected llama.cpp's server to start, found {e.strerror}; "
                            "check --llamacpp-python / --server-bin") from None
        except subprocess.SubprocessError as e:     # block_amx failed in the child
            raise UserError(f"--block-amx: expected a seccomp filter for llama.cpp's server, found {e}; "
                            "run without --block-amx") from None
        finally:
            if self.log:
                out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"llama.cpp's server: expected it to serve {self.gguf.name}, found it exited with "
                                f"code {self.proc.returncode}{self._log_tail()}; run `{shlex.join(self.command())}` "
                                "to see why")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise UserError(f"llama.cpp's server: expected /v1/models to answer within {self.ready_timeout_s:.0f} s, "
                        f"found no answer{self._log_tail()}; see its log")

    def _log_tail(self) -> str:
        if not self.log or not Path(self.log).is_file():
            return ""
        lines = [ln for ln in Path(self.log).read_text(errors="replace").splitlines() if ln.strip()]
        return f" (its log: {lines[-1].strip()[:200]})" if lines else ""

    def death(self) -> UserError | None:
        """What to say when the server died under load (None while it runs): SIGILL names --block-amx."""
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(2.0)      # a crash cuts the stream a moment before the process is gone
        except subprocess.TimeoutExpired:
            return None
        if code == -signal.SIGILL:
            return UserError(f"llama.cpp's server: expected it to answer, found it killed by SIGILL (an instruction "
                             f"this CPU refuses{self._log_tail()}); add --block-amx where the CPU advertises AMX")
        return UserError(f"llama.cpp's server: expected it to answer, found it exited with code {code}"
                         f"{self._log_tail()}; run `{self.shown()}` to see why")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the interleaved comparison ----------------------------------------------------------------------

OURS, PEER = "ours", "llama.cpp"


def compare(ours_url: str, peer, levels: list[int], rounds: int, prompts: list[str], max_tokens: int,
            requests: dict[int, int], ours_force_length: str = "ignore_eos", warmup: int = 2, log=print,
            on_level=None) -> dict:
    """Interleaved rounds (module docstring): raw[server][level] = [bench.serve level of each round].
    peer(c) is a context manager giving a started server with slots c (.url, .force_length)."""
    from bench import openai_client
    raw: dict = {OURS: {}, PEER: {}}
    for r in range(rounds):
        for i, c in enumerate(stats.round_order(levels, r)):
            order = (OURS, PEER) if (r + i) % 2 == 0 else (PEER, OURS)
            for who in order:
                if who == OURS:
                    url, force = ours_url, ours_force_length
                    level = _level(openai_client, url, c, requests[c], prompts, max_tokens, force, warmup)
                else:
                    with peer(c) as srv:
                        try:
                            level = _level(openai_client, srv.url, c, requests[c], prompts, max_tokens,
                                           srv.force_length, warmup)
                        except UserError as e:
                            raise srv.death() or e
                raw[who].setdefault(c, []).append(level)
                from bench.serve import summarize_level
                lv = summarize_level([level], c)
                log(f"  round {r + 1} c={c} {who}: {lv['completed']}/{lv['requests']} requests, "
                    f"{lv['tokens_per_s']:.1f} tok/s, TTFT p99 {lv['ttft']['p99_ms']:.0f} ms, "
                    f"{sum(lv['errors'].values())} errors")
                if on_level is not None:
                    on_level(raw)
    return raw


def _level(openai_client, url, c, n, prompts, max_tokens, force, warmup) -> dict:
    model = openai_client.served_model(url)
    openai_client.warm_up(url, prompts, max_tokens, warmup, model=model, force_length=force)
    return openai_client.run_level(url, c, n, prompts, max_tokens, model=model, force_length=force)


def summarize(raw: dict, levels: list[int]) -> dict:
    """Per server and level bench.serve's figures; per level ours / llama.cpp per round."""
    from bench.serve import round_tokens_per_s, summarize_level
    out = {"servers": {who: [summarize_level(raw[who][c], c) for c in levels if raw[who].get(c)] for who in raw},
           "ratios": {}}
    for c in levels:
        ours, peer = raw[OURS].get(c, []), raw[PEER].get(c, [])
        k = min(len(ours), len(peer))
        if k:
            out["ratios"][c] = stats.ratio_summary([round_tokens_per_s(x) for x in ours[:k]],
                                                   [round_tokens_per_s(x) for x in peer[:k]]).as_dict()
    return out


def _f(x, nd=1) -> str:
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def markdown(results: dict) -> str:
    s, summ = results["settings"], results["summary"]
    lines = [f"# bench.llamacpp compare: {results['started']}", "", f"`{results['command']}`", "",
             f"Ours {s['ours_url']} vs llama.cpp ({s['peer']}) on `{s['gguf']}`, threads {s['threads']} each; "
             f"{s['max_new_tokens']} new tokens per request (greedy, streamed /v1/completions), {len(s['prompts'])} "
             f"prompts in turn, {s['rounds']} round(s), levels and servers interleaved; load average "
             f"{' '.join(f'{x:.2f}' for x in results['machine']['loadavg_start'])} (start) / "
             f"{' '.join(f'{x:.2f}' for x in results['machine'].get('loadavg_end', []))} (end).", "",
             "| concurrency | server | requests | tok/s | tok/s per round (min / median / max) | "
             "TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    by = {who: {lv["concurrency"]: lv for lv in lvs} for who, lvs in summ["servers"].items()}
    for c in s["concurrency"]:
        for who in (OURS, PEER):
            lv = by.get(who, {}).get(c)
            if lv is None:
                continue
            r, t, i = lv["tokens_per_s_rounds"], lv["ttft"], lv["itl"]
            lines.append(f"| {c} | {who} | {lv['completed']}/{lv['requests']} | {_f(lv['tokens_per_s'])} | "
                         f"{_f(r['min'])} / {_f(r['median'])} / {_f(r['max'])} | "
                         f"{_f(t['p50_ms'])} / {_f(t['p90_ms'])} / {_f(t['p99_ms'])} | "
                         f"{_f(i['p50_ms'])} / {_f(i['p90_ms'])} / {_f(i['p99_ms'])} | {sum(lv['errors'].values())} |")
    if summ["ratios"]:
        lines += ["", "| concurrency | tok/s ours / llama.cpp per round: median [min, max] | TTFT p99 ms ours / llama.cpp |",
                  "|---|---|---|"]
        for c, v in summ["ratios"].items():
            o, p = by[OURS][int(c)]["ttft"]["p99_ms"], by[PEER][int(c)]["ttft"]["p99_ms"]
            lines.append(f"| {c} | {_f(v['median'], 2)}x [{_f(v['min'], 2)}, {_f(v['max'], 2)}] | {_f(o)} / {_f(p)} |")
    counted = {who: {} for who in summ["servers"]}
    for who, lvs in summ["servers"].items():
        for lv in lvs:
            for how, n in lv.get("tokens_counted_by", {}).items():
                counted[who][how] = counted[who].get(how, 0) + n
    lines += ["", "Output tokens counted from (bench/openai_client.py): " + "; ".join(
        f"{who}: " + ", ".join(f"{how} ({n} requests)" for how, n in c.items()) for who, c in counted.items() if c) + "."]
    lines += ["", "llama.cpp's server, per level:"] + [f"- c{c}: `{cmd}`" for c, cmd in s.get("peer_commands", {}).items()]
    errors = {}
    for who, lvs in summ["servers"].items():
        for lv in lvs:
            for msg, n in lv["errors"].items():
                errors[f"{who}: {msg}"] = errors.get(f"{who}: {msg}", 0) + n
    if errors:
        lines += ["", "Errors:"] + [f"- {n} x {msg}" for msg, n in sorted(errors.items(), key=lambda x: -x[1])]
    return "\n".join(lines) + "\n"


# --- CLI ---------------------------------------------------------------------------------------------

def _add_server_args(p, slots: bool) -> None:
    p.add_argument("--gguf", required=True, help=f"the GGUF to serve (OUT/{GGUF_NAME} of `gguf`)")
    p.add_argument("--llamacpp-python", help="a python that imports llama_cpp (llama-cpp-python[server]): "
                                             "serves with `python -m llama_cpp.server`")
    p.add_argument("--server-bin", help="llama.cpp's own llama-server binary instead (parallel slots)")
    p.add_argument("--threads", type=int_in(1, 1024), required=True,
                   help="decode and prompt threads (n_threads, n_threads_batch): the same as ours")
    p.add_argument("--block-amx", action="store_true",
                   help="make llama.cpp's AMX check fail (a seccomp filter), so it runs its kernels for a CPU "
                        "without AMX (for a CPU that advertises AMX whose tile instructions fault: SIGILL)")
    p.add_argument("--ctx-per-slot", type=int_in(64, 1 << 20), default=2048, help="context tokens per slot (default 2048)")
    if slots:
        p.add_argument("--slots", type=int_in(1, 256), default=1, help="llama-server's --parallel (default 1)")
        p.add_argument("--port", type=int_in(1, 65535), help="default: a free port")


def _parser():
    p = ArgumentParser(prog="python -m bench.llamacpp", description="llama.cpp's server as the peer of ours.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gguf", help="the folder as llama.cpp's Q4_0 GGUF")
    g.add_argument("--checkpoint", required=True, help="a random-init Hugging Face folder (bench.scale make)")
    g.add_argument("--source", required=True, help="llama-cpp-python's source package (.tar.gz) or its unpacked folder")
    q = g.add_mutually_exclusive_group(required=True)
    q.add_argument("--llamacpp-python", help="a python that imports llama_cpp (runs the quantizer)")
    q.add_argument("--quantize-bin", help="llama.cpp's llama-quantize binary instead (built with llama-server)")
    g.add_argument("--vocab", default="llama-bpe", help="llama.cpp's vocab-only GGUF to take the vocabulary from "
                                                       "(models/ggml-vocab-NAME.gguf; default llama-bpe: Llama 3)")
    g.add_argument("--threads", type=int_in(1, 1024), help="quantizer threads (default: every core)")
    g.add_argument("--out", required=True, help=f"the folder to write ({GGUF_NAME})")
    o = sub.add_parser("ours-folder", help="the folder for ours with the same vocabulary as tokenizer.json")
    o.add_argument("--checkpoint", required=True, help="a random-init Hugging Face folder (bench.scale make)")
    o.add_argument("--source", required=True, help="llama-cpp-python's source package (.tar.gz) or its unpacked folder")
    o.add_argument("--vocab", default="llama-bpe", help="llama.cpp's vocab-only GGUF (default llama-bpe: Llama 3)")
    o.add_argument("--out", required=True, help="the folder to write (links and tokenizer.json)")
    s = sub.add_parser("serve", help="start llama.cpp's server on the GGUF until Ctrl-C")
    _add_server_args(s, slots=True)
    s.add_argument("--log", help="the server's output (default: this terminal)")
    c = sub.add_parser("compare", help="ours vs llama.cpp, interleaved")
    c.add_argument("--ours-url", required=True, help="http://127.0.0.1:PORT of ours (runtime.triton serve --openai-port)")
    c.add_argument("--ours-force-length", choices=("ignore_eos", "min_tokens", "both", "none"), default="ignore_eos",
                   help="the field that makes ours generate exactly --max-new-tokens (default ignore_eos)")
    _add_server_args(c, slots=False)
    c.add_argument("--concurrency", default="1,4,16", help="comma list of concurrent clients (default 1,4,16)")
    c.add_argument("--requests", type=int_in(1, 100_000), help="requests per level, server and round (default: "
                                                               "4 x concurrency, at least 8)")
    c.add_argument("--prompts", help="UTF-8 text file, one prompt per line (default: bench.serve's built-in list)")
    c.add_argument("--max-new-tokens", type=int_in(1, 100_000), default=64, help="tokens per request (default 64)")
    c.add_argument("--rounds", type=int_in(1, 100), default=3, help="rounds (default 3)")
    c.add_argument("--warmup", type=int_in(0, 1000), default=2, help="untimed requests before each level (default 2)")
    c.add_argument("--out", required=True, help="results directory (results.json, results.md, server logs)")
    return p


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "gguf":
        make_gguf(args.checkpoint, args.out, source=args.source, python=args.llamacpp_python,
                  quantize_bin=args.quantize_bin, vocab=args.vocab, threads=args.threads)
        return 0
    if args.cmd == "ours-folder":
        ours_folder(args.checkpoint, args.out, source=args.source, vocab=args.vocab)
        return 0
    if args.cmd == "serve":
        srv = LlamaCppServer(args.gguf, slots=args.slots, threads=args.threads, python=args.llamacpp_python,
                             server_bin=args.server_bin, ctx_per_slot=args.ctx_per_slot, port=args.port, log=args.log,
                             block_amx=args.block_amx)
        print(srv.shown(), flush=True)
        with srv:
            print(f"llama.cpp's server ready at {srv.url} (pid {srv.proc.pid}); Ctrl-C stops it", flush=True)
            srv.proc.wait()
        return 0
    return _compare_cli(args, argv)


def _compare_cli(args, argv) -> int:
    from bench import openai_client
    from bench.runners import machine_info
    from bench.serve import default_requests, parse_levels, read_prompts
    openai_client.split_url(args.ours_url)
    levels = parse_levels(args.concurrency)
    prompts = read_prompts(args.prompts)
    if not Path(args.gguf).is_file():
        raise UserError(f"--gguf {args.gguf}: expected a GGUF file, found none; make it with `python -m bench.llamacpp gguf`")
    LlamaCppServer(args.gguf, slots=1, threads=args.threads, python=args.llamacpp_python, server_bin=args.server_bin,
                   block_amx=args.block_amx)                        # its usage errors, before any load
    check_output_dir(args.out, SERVE_RESULTS)
    openai_client.warm_up(args.ours_url, prompts, args.max_new_tokens, 1, model=openai_client.served_model(args.ours_url),
                          force_length=args.ours_force_length)      # ours reachable? refused before any load
    out = claim_dir(args.out, SERVE_RESULTS)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    command = "python -m bench.llamacpp " + shlex.join(sys.argv[1:] if argv is None else argv)
    machine = machine_info(gpu=False)
    settings = {"ours_url": args.ours_url, "ours_force_length": args.ours_force_length, "gguf": str(args.gguf),
                "peer": "llama-server" if args.server_bin else "llama-cpp-python (python -m llama_cpp.server)",
                "threads": args.threads, "block_amx": args.block_amx, "concurrency": levels,
                "requests": {c: args.requests or default_requests(c) for c in levels},
                "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "warmup": args.warmup, "prompts": prompts}

    def peer(c: int) -> LlamaCppServer:
        srv = LlamaCppServer(args.gguf, slots=c, threads=args.threads, python=args.llamacpp_python,
                             server_bin=args.server_bin, ctx_per_slot=args.ctx_per_slot, log=out / "llamacpp-server.log",
                             block_amx=args.block_amx)
        settings.setdefault("peer_commands", {})[c] = srv.shown()
        return srv

    def write(raw: dict) -> None:
        machine["loadavg_end"] = list(os.getloadavg())
        results = {"format": 1, "started": started, "command": command, "machine": machine, "settings": settings,
                   "summary": summarize(raw, levels)}
        replace_file_in(out, "results.json", json.dumps(results, indent=1) + "\n")
        replace_file_in(out, "results.md", markdown(results))

    print(f"bench.llamacpp compare: ours {args.ours_url} vs llama.cpp on {args.gguf}, levels {levels}, "
          f"{args.rounds} round(s)", flush=True)
    compare(args.ours_url, peer, levels, args.rounds, prompts, args.max_new_tokens, settings["requests"],
            args.ours_force_length, args.warmup, on_level=write)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
