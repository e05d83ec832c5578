"""bench.llamacpp: the source package's converter files, the server's commands and lifetime, the
interleaved comparison end to end against two fake OpenAI servers (tests/bench/fake_openai.py) standing in
for ours and llama.cpp's; and, where a python that imports llama_cpp and llama-cpp-python's source package
are given (TAPERNORM_LLAMACPP_PYTHON, TAPERNORM_LLAMACPP_SRC), the whole peer for real on a tiny folder:
GGUF conversion with the vocab-only GGUF's vocabulary, Q4_0 quantization, the server, the client."""
from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench import llamacpp, openai_client, serve
from core.errors import UserError
from tests.bench.fake_openai import start_fake, stop_fake


def _tarball(path: Path) -> Path:
    root = "llama_cpp_python-9.9.9/vendor/llama.cpp/"
    names = ["convert_hf_to_gguf.py", "conversion/llama.py", "gguf-py/gguf/__init__.py", "models/ggml-vocab-llama-bpe.gguf",
             "models/ggml-vocab-llama-bpe.gguf.inp", "src/llama.cpp", "convert_lora_to_gguf.py"]
    with tarfile.open(path, "w:gz") as tar:
        for n in names + ["../../outside.py"]:
            data = n.encode()
            info = tarfile.TarInfo(root + n if not n.startswith("..") else "llama_cpp_python-9.9.9/" + n)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_source_dir_takes_only_what_the_converter_needs(tmp_path):
    src = llamacpp.source_dir(_tarball(tmp_path / "sdist.tar.gz"), tmp_path / "work")
    assert src == tmp_path / "work/llama_cpp_python-9.9.9/vendor/llama.cpp"
    got = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    assert got == ["conversion/llama.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py",
                   "models/ggml-vocab-llama-bpe.gguf", "models/ggml-vocab-llama-bpe.gguf.inp"]
    assert not (tmp_path / "outside.py").exists()
    assert llamacpp.source_dir(tmp_path / "work/llama_cpp_python-9.9.9", tmp_path / "x") == src   # unpacked: as is
    for bad in (tmp_path / "missing.tar.gz", tmp_path):
        with pytest.raises(UserError, match="--source"):
            llamacpp.source_dir(bad, tmp_path / "y")


def test_server_commands_and_a_server_that_does_not_start(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    py = llamacpp.LlamaCppServer(gguf, slots=4, threads=2, python="/venv/bin/python", port=8123)
    cmd = py.command()
    assert cmd[:3] == ["/venv/bin/python", "-m", "llama_cpp.server"] and py.force_length == "min_tokens"
    # the same threads for decode and prompt; concurrent requests queue rather than cut the streaming one
    for flag, value in (("--n_threads", "2"), ("--n_threads_batch", "2"), ("--interrupt_requests", "False"),
                        ("--host", "127.0.0.1"), ("--port", "8123")):
        assert cmd[cmd.index(flag) + 1] == value
    blocked = llamacpp.LlamaCppServer(gguf, slots=4, threads=2, python="/venv/bin/python", port=8123, block_amx=True)
    assert blocked.command() == cmd and blocked.shown().endswith("(under --block-amx's seccomp filter)")
    native = llamacpp.LlamaCppServer(gguf, slots=4, threads=2, server_bin="/bin/llama-server", ctx_per_slot=512)
    cmd = native.command()
    assert cmd[cmd.index("--parallel") + 1] == "4" and cmd[cmd.index("--ctx-size") + 1] == "2048"
    assert native.force_length == "ignore_eos"
    log = tmp_path / "server.log"
    with pytest.raises(UserError, match="exited with code 1"):
        with llamacpp.LlamaCppServer(gguf, slots=1, threads=1, python="/bin/false", log=log):
            pass
    with pytest.raises(UserError, match="expected --llamacpp-python or --server-bin"):
        llamacpp.LlamaCppServer(gguf, slots=1, threads=1)
    # a server that dies under load: SIGILL (AMX on a CPU that advertises it) names --block-amx
    srv = llamacpp.LlamaCppServer(gguf, slots=1, threads=1, python=sys.executable)
    assert srv.death() is None
    srv.proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    srv.proc.wait()
    assert "add --block-amx" in str(srv.death())


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="an x86-64 Linux filter")
def test_block_amx_fails_exactly_llamacpps_amx_request():
    """--block-amx's seccomp filter: arch_prctl(ARCH_REQ_XCOMP_PERM) is EPERM, another arch_prctl goes through."""
    probe = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
             "r = libc.syscall(158, 0x1023, 18); e = ctypes.get_errno(); "
             "print(r, e, libc.syscall(158, 0x1022, ctypes.byref(ctypes.c_ulong())))")    # ARCH_GET_XCOMP_PERM
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, preexec_fn=llamacpp.block_amx)
    assert res.returncode == 0 and res.stdout.split() == ["-1", "1", "0"], res


class FakePeer:
    """LlamaCppServer's interface over a fake OpenAI server without usage (as llama-cpp-python streams)."""
    started: list = []

    def __init__(self, gguf, *, slots, threads, python=None, server_bin=None, ctx_per_slot=2048, port=None, log=None,
                 block_amx=False):
        self.slots, self.force_length = slots, "min_tokens"

    def command(self):
        return ["fake-llama-server", "--slots", str(self.slots)]

    def shown(self):
        return " ".join(self.command())

    def death(self):
        return None

    def __enter__(self):
        self.server, self.url, self.handler = start_fake(usage=False)
        FakePeer.started.append((self.slots, self.handler))
        return self

    def __exit__(self, *exc):
        stop_fake(self.server)


def test_compare_interleaved_end_to_end(tmp_path, monkeypatch, capsys):
    server, ours_url, ours = start_fake()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp, "LlamaCppServer", FakePeer)
    FakePeer.started = []
    out = tmp_path / "cmp"
    try:
        rc = llamacpp.main(["compare", "--ours-url", ours_url, "--gguf", str(gguf), "--llamacpp-python", "py",
                            "--threads", "2", "--concurrency", "1,4", "--rounds", "2", "--requests", "4",
                            "--max-new-tokens", "5", "--warmup", "1", "--out", str(out)])
    finally:
        stop_fake(server)
    assert rc == 0, capsys.readouterr().err
    log = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  round")]
    # levels rotate per round, and which server goes first alternates
    assert [ln.split(":")[0].strip() for ln in log] == [
        "round 1 c=1 ours", "round 1 c=1 llama.cpp", "round 1 c=4 llama.cpp", "round 1 c=4 ours",
        "round 2 c=4 llama.cpp", "round 2 c=4 ours", "round 2 c=1 ours", "round 2 c=1 llama.cpp"]
    assert [s for s, _ in FakePeer.started] == [1, 4, 4, 1]          # the peer's slots = the level
    peer_bodies = [b for _, h in FakePeer.started for b in h.bodies]
    assert all(b["min_tokens"] == 5 and "ignore_eos" not in b for b in peer_bodies)
    assert all(b["ignore_eos"] is True and "min_tokens" not in b and b["model"] == "generate" for b in ours.bodies)
    results = json.loads((out / "results.json").read_text())
    for who in ("ours", "llama.cpp"):
        lvs = results["summary"]["servers"][who]
        assert [lv["concurrency"] for lv in lvs] == [1, 4]
        assert all((lv["rounds"], lv["completed"], lv["tokens"], lv["errors"]) == (2, 8, 40, {}) for lv in lvs)
        assert all(lv["tokens_counted_by"] == ({"usage": 8} if who == "ours" else {"length": 8}) for lv in lvs)
    assert set(results["summary"]["ratios"]) == {"1", "4"}
    assert results["settings"]["peer_commands"] == {"1": "fake-llama-server --slots 1", "4": "fake-llama-server --slots 4"}
    md = (out / "results.md").read_text()
    assert "| 4 | llama.cpp | 8/8 |" in md and "tok/s ours / llama.cpp per round" in md
    assert "ours: usage (16 requests); llama.cpp: length (16 requests)" in md and "- c4: `fake-llama-server --slots 4`" in md


def test_compare_refuses_before_any_load(tmp_path, capsys):
    rc = llamacpp.main(["compare", "--ours-url", "http://127.0.0.1:9", "--gguf", str(tmp_path / "none.gguf"),
                        "--llamacpp-python", "py", "--threads", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and "--gguf" in err and err.count("\n") == 1 and not (tmp_path / "o").exists()



@pytest.mark.parametrize("quantizer, needle", [
    ([], "one of the arguments --llamacpp-python --quantize-bin is required"),
    (["--llamacpp-python", "py", "--quantize-bin", "q"], "not allowed with argument --llamacpp-python"),
    (["--quantize-bin", "no-such-llama-quantize"], "--quantize-bin no-such-llama-quantize: expected llama.cpp's"),
])
def test_gguf_takes_exactly_one_quantizer_that_exists(tmp_path, capsys, quantizer, needle):
    rc = llamacpp.main(["gguf", "--checkpoint", str(tmp_path), "--source", str(tmp_path), "--out",
                        str(tmp_path / "o"), *quantizer])
    err = capsys.readouterr().err
    assert rc != 0 and needle in err and err.count("\n") == 1 and not (tmp_path / "o").exists(), err

# --- llama.cpp for real ------------------------------------------------------------------------------

LLAMACPP_PYTHON = os.environ.get("TAPERNORM_LLAMACPP_PYTHON", sys.executable)
LLAMACPP_SRC = os.environ.get("TAPERNORM_LLAMACPP_SRC")


def _llamacpp_missing() -> str | None:
    try:
        r = subprocess.run([LLAMACPP_PYTHON, "-c", "import llama_cpp.server"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{LLAMACPP_PYTHON}: {e}"
    if r.returncode != 0:
        return f"llama_cpp.server is not importable by {LLAMACPP_PYTHON} (set TAPERNORM_LLAMACPP_PYTHON)"
    if not LLAMACPP_SRC:
        return "TAPERNORM_LLAMACPP_SRC (llama-cpp-python's source package, .tar.gz or unpacked) is not set"
    return None


TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", attention_bias=False,
                  mlp_bias=False, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, vocab_size=128256,
                  rope_theta=500000.0, initializer_range=0.02, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  tie_word_embeddings=True, max_position_embeddings=2048,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})


@pytest.mark.skipif(not LLAMACPP_SRC, reason="TAPERNORM_LLAMACPP_SRC (llama-cpp-python's source package) is not set")
def test_ours_folder_tokenizes_as_llamacpp(tmp_path):
    """tokenizer.json rebuilt from the vocab-only GGUF gives llama.cpp's own test ids (models/*.gguf.inp/.out)."""
    from tokenizers import Tokenizer
    from bench.shapes import write_random_folder
    folder = write_random_folder(dict(TINY_LLAMA), tmp_path / "tiny", log=lambda *a: None)
    out = llamacpp.ours_folder(folder, tmp_path / "ours", source=LLAMACPP_SRC, log=lambda *a: None)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
        ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    src = llamacpp.source_dir(LLAMACPP_SRC, tmp_path / "src")
    inp = (src / "models/ggml-vocab-llama-bpe.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (src / "models/ggml-vocab-llama-bpe.gguf.out").read_text(encoding="utf-8").split("\n")
    cases = list(zip(inp, ids))
    assert len(cases) > 40
    for text, want in cases:
        assert tok.encode(text, add_special_tokens=False).ids == [int(x) for x in want.split()], text
    assert tok.encode("Hello world").ids == [128000, 9906, 1917]       # <|begin_of_text|> first, as llama.cpp adds it
    # an unpacked source package is used where it is
    again = llamacpp.ours_folder(folder, tmp_path / "ours2", source=src.parent.parent, log=lambda *a: None)
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    with pytest.raises(UserError, match="vocab_size"):
        llamacpp.ours_folder(write_random_folder(dict(TINY_LLAMA, vocab_size=1000), tmp_path / "small",
                                                 log=lambda *a: None), tmp_path / "o2", source=LLAMACPP_SRC)
    assert not (tmp_path / "o2").exists()


@pytest.mark.slow
def test_against_llamacpp_server_on_a_tiny_gguf(tmp_path):
    missing = _llamacpp_missing()
    if missing:
        pytest.skip(missing)
    from bench.shapes import write_random_folder
    folder = write_random_folder(dict(TINY_LLAMA), tmp_path / "tiny", log=lambda *a: None)
    gguf = llamacpp.make_gguf(folder, tmp_path / "gguf", source=LLAMACPP_SRC, python=LLAMACPP_PYTHON, threads=1)
    assert gguf.read_bytes()[:4] == b"GGUF" and not (tmp_path / "gguf/model-f16.gguf").exists()
    # block_amx: harmless where AMX works; where the CPU advertises it and its tiles fault (this project's
    # VMs) llama.cpp would die with SIGILL on the first request
    with llamacpp.LlamaCppServer(gguf, slots=2, threads=1, ctx_per_slot=256, python=LLAMACPP_PYTHON,
                                 log=tmp_path / "server.log", block_amx=True) as srv:
        level = openai_client.run_level(srv.url, 2, 4, ["Once upon a time", "A boy"], 8,
                                        force_length=srv.force_length)
    lv = serve.summarize_level([level], 2)
    assert (lv["completed"], lv["tokens"], lv["errors"]) == (4, 32, {}), lv
    assert lv["tokens_counted_by"] == {"length": 4}      # llama-cpp-python streams no usage
