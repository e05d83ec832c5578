"""The catalog of bad and careless input, across every command (issue: "Nothing lost, one clear line").

Every case runs the command's main(argv) in-process and asserts: exactly one `error:` line on
stderr, no traceback, the expected exit code (1 bad input, 2 bad usage), and every file under
the scratch folder byte-for-byte as it was (nothing written, nothing replaced, nothing deleted).
Cases that must succeed (a replace of our own output) check what they must keep.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.cli.conftest import COMMANDS, cli, copy_tree
from tests.helpers import random_model, snapshot, tiny_tokenizer_json, write_checkpoint

TINY_TRAIN = ["--d-model", "16", "--n-layer", "1", "--n-head", "2", "--batch-size", "2", "--seq-len", "16",
              "--eval-batches", "1", "--calib-batches", "1", "--corpus-stories", "100", "--quiet", "--threads", "1",
              "--steps", "2"]


def _hf_folder(s: Path) -> Path:
    hf = s / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 16}))
    (hf / "pytorch_model.bin").write_bytes(os.urandom(256))
    (hf / "README.md").write_text("# my model\n")
    return hf


def _hf_config_only(s: Path, model_type: str = "gpt2") -> Path:
    hf = s / "hfc"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": model_type, "n_embd": 16, "n_layer": 1, "n_head": 2}))
    return hf


def _hf_sharded_with_bad_shard(s: Path) -> Path:
    """A real (tiny, random) Llama folder in shards, one shard holding a tensor of the wrong shape."""
    from safetensors.torch import load_file, save_file
    from tests.hf_models import hf_model, save_hf
    import torch
    hf = save_hf(hf_model("llama"), s / "hfs", max_shard_size="20KB")
    shard = sorted(hf.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    tensors[sorted(tensors)[0]] = torch.zeros(3, 5)
    save_file(tensors, str(shard))
    return hf


def _tokenizer_less(s: Path, build: Path) -> None:
    """A build and a checkpoint of a model converted from a folder without tokenizer.json."""
    from models.checkpoint import save_checkpoint
    b = copy_tree(build, s / "b")
    (b / "tokenizer.json").unlink()
    save_checkpoint(random_model(seed=1, n_layer=1, max_seq_len=16), s / "ck", None)


def _user_repo(s: Path) -> Path:
    repo = s / "repo" / "my_model"
    repo.mkdir(parents=True)
    (repo / "config.pbtxt").write_text('name: "my_model"\nbackend: "python"\n')
    (repo / "1").mkdir()
    (repo / "1" / "model.py").write_text("# the user's model\n")
    return repo.parent


def _hf_gpt2(s: Path) -> Path:
    """A real (tiny, random) GPT-2 folder, as save_pretrained writes it."""
    from tests.hf_models import hf_model, save_hf
    return save_hf(hf_model("gpt2"), s / "hf")


def _hf_family_config(s: Path, family: str, **changes) -> Path:
    """A config-only folder of tests.hf_models' FAMILIES[family], fields `changes` changed (JSON Infinity for inf)."""
    from tests.hf_models import FAMILIES, VOCAB
    model_type, overrides = FAMILIES[family]
    hf = s / "hfc"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": VOCAB, **overrides, **changes}))
    return hf


def _hf_llama_with_nan(s: Path) -> Path:
    """A real (tiny, random) Llama folder whose model.layers.0.mlp.up_proj.weight holds a NaN."""
    from safetensors.torch import load_file, save_file
    from tests.hf_models import hf_model, save_hf
    hf = save_hf(hf_model("llama"), s / "hf")
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return hf


def _ckpt_with_huge_weight(s: Path) -> Path:
    """A checkpoint whose blocks.0.attn.q_proj.weight holds 3e38 (finite in fp32)."""
    import torch
    model = random_model(seed=3, n_layer=1, max_seq_len=32)
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight[0, 0] = 3e38
    return write_checkpoint(s / "huge", model)


def _text_folder(s: Path) -> Path:
    from train.corpus import generate_stories
    src = s / "texts"
    src.mkdir()
    (src / "stories.txt").write_text("\n\n".join(generate_stories(20, seed=5)))
    return src


def _our_repo(s: Path, build: Path) -> Path:
    r = cli("runtime.triton", ["repo", "--build", build, "--out", s / "repo"])
    assert r.code == 0, r.err
    return s / "repo"


def _project(s: Path) -> Path:
    p = s / "project"
    (p / "src").mkdir(parents=True)
    (p / "src" / "main.py").write_text("print('hi')\n")
    (p / "README.md").write_text("mine\n")
    return p


def _plain_file(s: Path) -> Path:
    f = s / "X"
    f.write_text("a plain file\n")
    return f


def _onnx_named(s: Path) -> Path:
    o = s / "o"
    o.mkdir()
    (o / "model.onnx").write_text("")
    (o / "notes.md").write_text("my notes\n")
    return o


def _foreign_graph(s: Path) -> Path:
    """An ONNX model that is no decoder: x -> Relu -> y."""
    import onnx
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(g), s / "relu.onnx")
    return s / "relu.onnx"


def _binary(s: Path, name: str = "bin.dat") -> Path:
    p = s / name
    p.write_bytes(bytes(range(256)) * 4)
    return p


def _ckpt_with(s: Path, tiny_ckpt: Path, name: str, edit) -> Path:
    ck = copy_tree(tiny_ckpt, s / name)
    edit(ck)
    return ck


def _config_edit(key, value):
    def edit(ck):
        cfg = json.loads((ck / "config.json").read_text())
        cfg[key] = value
        (ck / "config.json").write_text(json.dumps(cfg))
    return edit


def _weights_dtype(dtype):
    def edit(ck):
        from safetensors.torch import load_file, save_file
        import torch
        t = load_file(str(ck / "model.safetensors"))
        name = next(k for k in t if k.endswith("ln_f.weight"))
        t[name] = t[name].to(getattr(torch, dtype))
        save_file(t, str(ck / "model.safetensors"))
    return edit


def _big_tokenizer(s: Path) -> Path:
    ck = s / "small_vocab"
    return write_checkpoint(ck, random_model(seed=0, vocab_size=100, n_layer=1, max_seq_len=16))


def _external_data_missing(s: Path, build: Path) -> Path:
    """The unfused build's model.onnx re-saved with its weights in m.onnx.data, then that file deleted."""
    import onnx
    d = s / "ext"
    d.mkdir()
    onnx.save(onnx.load(str(build / "model.onnx")), str(d / "m.onnx"), save_as_external_data=True,
              location="m.onnx.data", size_threshold=0)
    (d / "m.onnx.data").unlink()
    return d / "m.onnx"


class _Garbage:
    """A TCP server on loopback answering every connection with bytes no HTTP client can read
    (what a Triton HTTP client sees when pointed at the gRPC port)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff")  # an HTTP/2 SETTINGS frame
            finally:
                conn.close()

    def close(self):
        self.sock.close()


# (id, command, argv; {s} scratch, {ckpt}, {build} (fused), {unfused}, {run}; setup(s, fx) -> None, exit code,
#  needle in the error line)
CASES = [
    # --- data loss: refused, the user's files unchanged -----------------------------------------
    ("triton-repo-over-checkpoint", "runtime.triton", ["repo", "--build", "{build}", "--out", "{s}/ck"],
     lambda s, fx: copy_tree(fx["ckpt"], s / "ck"), 1, "holds a checkpoint written by tapernorm-deploy, not a Triton"),
    ("triton-repo-over-users-repository", "runtime.triton", ["repo", "--build", "{build}", "--out", "{s}/repo"],
     lambda s, fx: _user_repo(s), 1, "did not write"),
    ("triton-repo-over-its-build", "runtime.triton", ["repo", "--build", "{s}/b", "--out", "{s}/b"],
     lambda s, fx: copy_tree(fx["build"], s / "b"), 1, "own input"),
    ("triton-repo-over-parent-of-build", "runtime.triton", ["repo", "--build", "{s}/b", "--out", "{s}"],
     lambda s, fx: copy_tree(fx["build"], s / "b"), 1, "own input"),
    ("triton-repo-over-project", "runtime.triton", ["repo", "--build", "{build}", "--out", "{s}/project"],
     lambda s, fx: _project(s), 1, "did not write"),
    ("triton-repo-over-plain-file", "runtime.triton", ["repo", "--build", "{build}", "--out", "{s}/X"],
     lambda s, fx: _plain_file(s), 1, "found a file"),
    ("build-triton-repo-over-checkpoint", "export.build",
     ["--checkpoint", "{ckpt}", "--out", "{s}/b2", "--triton-repo", "{s}/ck"],
     lambda s, fx: copy_tree(fx["ckpt"], s / "ck"), 1, "not a Triton model repository"),
    ("train-over-hf-folder", "train", ["--preset", "baseline", "--out", "{s}/hf", *TINY_TRAIN],
     lambda s, fx: _hf_folder(s), 1, "did not write"),
    ("train-over-zoo-copy", "train", ["--preset", "baseline", "--out", "{s}/zoo", *TINY_TRAIN],
     lambda s, fx: copy_tree(Path("models/zoo/baseline").resolve(), s / "zoo"), 1, "holds a checkpoint"),
    ("train-lr-inf-over-zoo-copy", "train", ["--preset", "baseline", "--out", "{s}/zoo", "--lr", "inf", *TINY_TRAIN],
     lambda s, fx: copy_tree(Path("models/zoo/baseline").resolve(), s / "zoo"), 2, "--lr inf"),
    ("train-new-run-over-held-run", "train", ["--preset", "baseline", "--out", "{s}/run", *TINY_TRAIN],
     lambda s, fx: copy_tree(fx["run"], s / "run"), 1, "holds a training run at step 4"),
    ("build-over-folder-with-model-onnx", "export.build", ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/o"],
     lambda s, fx: _onnx_named(s), 1, "did not write"),
    ("build-over-its-checkpoint", "export.build", ["--checkpoint", "{s}/ck", "--out", "{s}/ck"],
     lambda s, fx: copy_tree(fx["ckpt"], s / "ck"), 1, "own input"),
    ("graph-passes-over-its-input", "graph_passes", ["{s}/m.onnx", "-o", "{s}/m.onnx"],
     lambda s, fx: shutil.copy(fx["unfused"] / "model.onnx", s / "m.onnx"), 1, "own input"),
    ("graph-passes-over-users-file", "graph_passes", ["{unfused}/model.onnx", "-o", "{s}/X"],
     lambda s, fx: _plain_file(s), 1, "not written by tapernorm-deploy"),
    ("bench-report-into-users-folder", "bench.report", ["{s}/project"],
     lambda s, fx: _project(s), 1, "results.json"),
    ("train-tokenizer-over-users-file", "train.tokenizer", ["--out", "{s}/X", "--stories", "10"],
     lambda s, fx: _plain_file(s), 1, "not written by tapernorm-deploy"),
    # --- wrong output with exit 0, before ---------------------------------------------------------
    ("graph-passes-empty-onnx", "graph_passes", ["{s}/e.onnx", "-o", "{s}/o.onnx"],
     lambda s, fx: (s / "e.onnx").write_bytes(b""), 1, "empty file"),
    ("verify-empty-onnx", "export.verify", ["{s}/e.onnx", "{unfused}/model.onnx"],
     lambda s, fx: (s / "e.onnx").write_bytes(b""), 1, "empty file"),
    ("generate-empty-onnx", "runtime.generate", ["--model", "{s}/e.onnx", "--prompt", "hi"],
     lambda s, fx: (s / "e.onnx").write_bytes(b""), 1, "e.onnx"),
    ("checkpoint-tokenizer-larger-than-vocab", "models.checkpoint", ["{s}/small_vocab"],
     lambda s, fx: _big_tokenizer(s), 1, "vocab_size is 100"),
    ("build-tokenizer-larger-than-vocab", "export.build", ["--checkpoint", "{s}/small_vocab", "--out", "{s}/b"],
     lambda s, fx: _big_tokenizer(s), 1, "vocab_size is 100"),
    ("checkpoint-int32-weight", "models.checkpoint", ["{s}/ck"],
     lambda s, fx: _ckpt_with(s, fx["ckpt"], "ck", _weights_dtype("int32")), 1, "dtype int32"),
    ("checkpoint-bool-weight", "models.checkpoint", ["{s}/ck"],
     lambda s, fx: _ckpt_with(s, fx["ckpt"], "ck", _weights_dtype("bool")), 1, "dtype bool"),
    ("verify-unknown-io-convention", "export.verify", ["{s}/relu.onnx", "{unfused}/model.onnx"],
     lambda s, fx: _foreign_graph(s), 1, "unknown decoder I/O convention"),
    ("verify-reference-missing", "export.verify", ["{unfused}/model.onnx", "{build}/model.fused.onnx", "--reference",
                                                   "{s}/none.onnx"], None, 1, "no such file"),
    ("verify-negative-atol", "export.verify", ["{unfused}/model.onnx", "{build}/model.fused.onnx", "--atol", "-1"],
     None, 2, "--atol"),
    ("triton-repo-negative-max-new-tokens", "runtime.triton",
     ["repo", "--build", "{build}", "--out", "{s}/r", "--max-new-tokens", "-5"], None, 2, "--max-new-tokens"),
    # --- tracebacks, before -----------------------------------------------------------------------------
    ("generate-stop-id-not-a-number", "runtime.generate", ["--model", "{build}", "--prompt", "hi", "--stop", "id:abc"],
     None, 2, "--stop 'id:abc'"),
    ("generate-stop-id-out-of-vocab", "runtime.generate", ["--model", "{build}", "--prompt", "hi", "--stop", "id:99999"],
     None, 1, "--stop 'id:99999'"),
    ("generate-bogus-device", "runtime.generate", ["--model", "{build}", "--prompt", "hi", "--device", "bogus"],
     None, 2, "--device 'bogus'"),
    ("generate-bogus-torch-device", "runtime.generate",
     ["--model", "{ckpt}", "--backend", "torch", "--prompt", "hi", "--device", "bogus"], None, 2, "--device 'bogus'"),
    ("generate-negative-seed", "runtime.generate",
     ["--model", "{build}", "--prompt", "hi", "--seed", "-1", "--temperature", "1"], None, 2, "--seed"),
    ("generate-binary-batch-file", "runtime.generate", ["--model", "{build}", "--batch-file", "{s}/bin.dat"],
     lambda s, fx: _binary(s), 1, "binary data"),
    ("generate-batch-file-is-a-directory", "runtime.generate", ["--model", "{build}", "--batch-file", "{s}"],
     None, 1, "found a directory"),
    ("generate-20000-line-batch-file", "runtime.generate", ["--model", "{build}", "--batch-file", "{s}/many.txt"],
     lambda s, fx: (s / "many.txt").write_text("once upon a time\n" * 20000), 1, "at most 256 prompts"),
    ("generate-non-utf8-prompt", "runtime.generate", ["--model", "{build}", "--prompt", "bad \udcff byte"],
     None, 1, "UTF-8"),
    ("generate-max-new-tokens-2-40", "runtime.generate", ["--model", "{build}", "--prompt", "hi", "--max-new-tokens",
                                                           str(2**40)], None, 2, "out of range"),
    ("generate-usage-without-model", "runtime.generate", ["--prompt", "hi"], None, 2, "--model"),
    ("checkpoint-config-is-a-directory", "models.checkpoint", ["{s}/ck"],
     lambda s, fx: _ckpt_with(s, fx["ckpt"], "ck", lambda ck: ((ck / "config.json").unlink(), (ck / "config.json").mkdir())),
     1, "found a directory"),
    ("checkpoint-config-not-utf8", "models.checkpoint", ["{s}/ck"],
     lambda s, fx: _ckpt_with(s, fx["ckpt"], "ck", lambda ck: (ck / "config.json").write_bytes(b"{\xff\xfe}")),
     1, "UTF-8"),
    ("checkpoint-capacity-1e9", "models.checkpoint", ["{s}/ck"],
     lambda s, fx: _ckpt_with(s, fx["ckpt"], "ck", _config_edit("max_seq_len", 1_000_000_000)), 1, "needs"),
    ("graph-passes-output-is-a-directory", "graph_passes", ["{unfused}/model.onnx", "-o", "{s}"],
     None, 1, "found a directory"),
    ("graph-passes-missing-external-data", "graph_passes", ["{s}/ext/m.onnx", "-o", "{s}/o.onnx"],
     lambda s, fx: _external_data_missing(s, fx["unfused"]), 1, "external-data file m.onnx.data"),
    ("verify-missing-external-data", "export.verify", ["{s}/ext/m.onnx", "{unfused}/model.onnx"],
     lambda s, fx: _external_data_missing(s, fx["unfused"]), 1, "external-data file m.onnx.data"),
    ("train-binary-corpus", "train", ["--preset", "baseline", "--out", "{s}/new", "--corpus", "{s}/bin.dat",
                                      *TINY_TRAIN], lambda s, fx: _binary(s), 1, "binary data"),
    ("triton-check-binary-config", "runtime.triton", ["check", "--repo", "{s}/repo"],
     lambda s, fx: (_user_repo(s) / "my_model" / "config.pbtxt").write_bytes(bytes(range(256))), 1, "config"),
    ("triton-check-not-a-directory", "runtime.triton", ["check", "--repo", "{s}/X"],
     lambda s, fx: _plain_file(s), 1, "found a file"),
    ("triton-client-non-utf8-prompt", "runtime.triton",
     ["client", "--url", "127.0.0.1:9", "--prompt", "bad \udcff"], None, 1, "UTF-8"),
    ("triton-client-max-new-tokens-2-40", "runtime.triton",
     ["client", "--url", "127.0.0.1:9", "--prompt", "hi", "--max-new-tokens", str(2**40)], None, 2, "out of range"),
    ("triton-client-nothing-listening", "runtime.triton",
     ["client", "--url", "127.0.0.1:{closed_port}", "--prompt", "hi", "--timeout", "5"], None, 1, "127.0.0.1"),
    ("triton-client-http-to-a-non-http-port", "runtime.triton",
     ["client", "--url", "127.0.0.1:{garbage_port}", "--prompt", "hi", "--timeout", "5"], None, 1, "127.0.0.1"),
    ("triton-usage-unknown-subcommand", "runtime.triton", ["bogus"], None, 2, "invalid choice"),
    # one port for two listeners: refused before a server starts (was: Triton's usage text, then our line)
    ("triton-serve-http-port-is-grpc-port", "runtime.triton",
     ["serve", "--repo", "{s}/repo", "--http-port", "{closed_port}", "--grpc-port", "{closed_port}"],
     lambda s, fx: _our_repo(s, fx["build"]), 2, "--http-port and --grpc-port"),
    ("triton-serve-metrics-port-is-http-port", "runtime.triton",
     ["serve", "--repo", "{s}/repo", "--grpc-port", "{closed_port}", "--metrics-port", "8000"],
     lambda s, fx: _our_repo(s, fx["build"]), 2, "--http-port and --metrics-port"),
    ("triton-repo-zero-slots", "runtime.triton", ["repo", "--build", "{build}", "--out", "{s}/r", "--slots", "0"],
     None, 2, "--slots"),
    ("triton-client-stream-nothing-listening", "runtime.triton",
     ["client", "--url", "127.0.0.1:{closed_port}", "--prompt", "hi", "--protocol", "grpc", "--stream", "--timeout", "5"],
     None, 1, "expected a server there"),
    ("bench-serve-remote-url", "bench.serve", ["--url", "10.1.2.3:8001", "--out", "{s}/r"], None, 2, "loopback"),
    ("bench-serve-bad-concurrency", "bench.serve", ["--url", "127.0.0.1:9", "--concurrency", "0,x", "--out", "{s}/r"],
     None, 2, "--concurrency"),
    ("bench-serve-nothing-listening", "bench.serve",
     ["--url", "127.0.0.1:{closed_port}", "--timeout", "5", "--out", "{s}/r"], None, 1, "expected a server there"),
    ("bench-serve-binary-prompts", "bench.serve", ["--url", "127.0.0.1:9", "--prompts", "{s}/bin.dat", "--out", "{s}/r"],
     lambda s, fx: _binary(s), 1, "binary data"),
    ("bench-serve-into-users-folder", "bench.serve", ["--url", "127.0.0.1:{closed_port}", "--out", "{s}/project"],
     lambda s, fx: _project(s), 1, "project"),
    ("bench-serve-openai-remote-url", "bench.serve", ["--api", "openai", "--url", "http://10.1.2.3:8080", "--out", "{s}/r"],
     None, 2, "loopback"),
    ("bench-serve-openai-nothing-listening", "bench.serve",
     ["--api", "openai", "--url", "http://127.0.0.1:{closed_port}", "--timeout", "5", "--out", "{s}/r"], None, 1,
     "ConnectionRefusedError"),
    ("bench-serve-openai-garbage-server", "bench.serve",
     ["--api", "openai", "--url", "127.0.0.1:{garbage_port}", "--timeout", "5", "--out", "{s}/r"], None, 1,
     "expected a streamed /v1/completions answer"),
    ("bench-serve-openai-into-users-folder", "bench.serve",
     ["--api", "openai", "--url", "http://127.0.0.1:{closed_port}", "--out", "{s}/project"],
     lambda s, fx: _project(s), 1, "project"),
    ("bench-llamacpp-gguf-no-folder", "bench.llamacpp",
     ["gguf", "--checkpoint", "{s}/nothing", "--source", "{s}/nothing.tar.gz", "--llamacpp-python", "py", "--out", "{s}/g"],
     None, 1, "--checkpoint"),
    ("bench-llamacpp-gguf-bad-source", "bench.llamacpp",
     ["gguf", "--checkpoint", "{ckpt}", "--source", "{s}/bin.dat", "--llamacpp-python", "py", "--out", "{s}/g"],
     lambda s, fx: _binary(s), 1, "--source"),
    ("bench-llamacpp-serve-no-gguf", "bench.llamacpp",
     ["serve", "--gguf", "{s}/none.gguf", "--llamacpp-python", "py", "--threads", "1"], None, 1, "--gguf"),
    ("bench-llamacpp-compare-nothing-listening", "bench.llamacpp",
     ["compare", "--ours-url", "http://127.0.0.1:{closed_port}", "--gguf", "{s}/bin.dat", "--llamacpp-python", "py",
      "--threads", "1", "--out", "{s}/r"], lambda s, fx: _binary(s), 1, "ConnectionRefusedError"),
    ("bench-slots-prompt-over-capacity", "bench.slots", ["--model", "{build}", "--prompt", "40", "--threads", "1"],
     None, 1, "--prompt 40"),
    ("bench-slots-json-over-users-file", "bench.slots", ["--model", "{build}", "--json", "{s}/X"],
     lambda s, fx: _plain_file(s), 1, "X"),
    ("bench-slots-missing-model", "bench.slots", ["--model", "{s}/nothing"], None, 1, "nothing"),
    ("bench-decode-usage-bad-batches", "bench.decode", ["--out", "{s}/r", "--batches", "0,x"], None, 2, "--batches"),
    ("bench-decode-unknown-size", "bench.decode", ["--out", "{s}/r", "--sizes", "9T"], None, 2, "unknown size"),
    ("bench-decode-cache-in-users-folder", "bench.decode", ["--out", "{s}/r", "--cache", "{s}/project", "--build-only"],
     lambda s, fx: _project(s), 1, "choose another --cache"),
    ("gpu-decode-unknown-size", "bench.gpu_decode", ["--sizes", "1M,9T"], None, 2, "--sizes"),
    ("gpu-decode-bad-batches", "bench.gpu_decode", ["--batches", "0,x"], None, 2, "--batches"),
    ("gpu-decode-two-rounds", "bench.gpu_decode", ["--rounds", "2"], None, 2, "--rounds"),
    ("gpu-decode-json-over-a-users-file", "bench.gpu_decode", ["--json", "{s}/X"], lambda s, fx: _plain_file(s), 1,
     "not written by tapernorm-deploy"),
    ("bench-decode-unknown-dtype", "bench.decode", ["--out", "{s}/r", "--dtypes", "fp32,int2"], None, 2, "unknown dtype"),
    ("bench-decode-unknown-attention", "bench.decode", ["--out", "{s}/r", "--attention", "flash"], None, 2, "invalid choice"),
    ("bench-decode-capacity-below-prompt-plus-new-tokens", "bench.decode",
     ["--out", "{s}/r", "--capacity", "64", "--new-tokens", "128"], None, 2, "--capacity 64"),
    ("quant-quality-unknown-kind", "bench.quant_quality", ["--json", "{s}/q.json", "--kinds", "gpt9"], None, 2, "gpt9"),
    ("build-quantize-without-fuse", "export.build", ["--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int4"],
     None, 2, "add --fuse"),
    ("build-quantize-fp16", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int4", "--dtype", "fp16"], None, 2, "--dtype fp32"),
    ("build-head-without-quantize", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--head", "int8"], None, 2, "--head"),
    ("build-quantize-block-size-not-power-of-2", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int4", "--block-size", "48"], None, 2,
     "--block-size"),
    # ONNX Runtime's quantizer takes blocks of 16..256 only: refused up front, not after the export
    ("build-quantize-int4-block-size-1024", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int4", "--block-size", "1024"], None, 2,
     "--block-size"),
    ("build-quantize-int8-block-size-512", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int8", "--block-size", "512"], None, 2,
     "--block-size"),
    ("quant-quality-block-size-1024", "bench.quant_quality", ["--json", "{s}/q.json", "--block-size", "1024"], None, 2,
     "--block-size"),
    ("build-quantize-hqq-int8", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int8", "--algo", "hqq"], None, 2, "4-bit only"),
    ("build-int8-layers-without-quantize", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--int8-layers", "v_proj"], None, 2, "--int8-layers"),
    ("build-int8-layers-unknown-layer", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int4", "--int8-layers", "v_prj"], None, 1,
     "--int8-layers v_prj"),
    ("ort-kernels-width-not-whole-heads", "bench.ort_kernels", ["--d-model", "100"], None, 2, "multiple of 64"),
    ("build-block-size-without-quantize", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--block-size", "64"], None, 2, "--quantize"),
    ("build-quantize-unknown-dtype", "export.build", ["--fuse", "--quantize", "int2"], None, 2, "invalid choice"),
    ("build-gqa-without-fuse", "export.build", ["--checkpoint", "{ckpt}", "--out", "{s}/b", "--attention", "gqa"],
     None, 2, "add --fuse"),
    ("build-gqa-fp16", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--attention", "gqa", "--dtype", "fp16"], None, 2,
     "use --attention fused"),
    ("screen-dyt-zero-steps", "train.screen_dyt", ["--steps", "0"], None, 2, "--steps"),
    ("train-report-no-runs", "train.report", ["--runs", "{s}"], None, 1, "no <preset>/train_log.json"),
    # --- data parallel and token shards (issue 16) ------------------------------------------------
    ("train-data-missing", "train", ["--preset", "baseline", "--out", "{s}/new", "--data", "{s}/nope.jsonl", *TINY_TRAIN],
     None, 1, "nope.jsonl: not found"),
    ("train-data-and-corpus", "train", ["--preset", "baseline", "--out", "{s}/new", "--data", "{s}/X", "--corpus",
                                        "{s}/X", *TINY_TRAIN], lambda s, fx: _plain_file(s), 2, "expected one source"),
    ("train-data-users-folder-of-code", "train", ["--preset", "baseline", "--out", "{s}/new", "--data", "{s}/project",
                                                  *TINY_TRAIN], lambda s, fx: _project(s), 1, "no .jsonl"),
    ("train-data-binary", "train", ["--preset", "baseline", "--out", "{s}/new", "--data", "{s}/bin.dat", *TINY_TRAIN],
     lambda s, fx: _binary(s), 1, "binary data"),
    ("train-shards-into-users-folder", "train", ["--preset", "baseline", "--out", "{s}/new", "--data", "{s}/X",
                                                 "--shards", "{s}/project", *TINY_TRAIN],
     lambda s, fx: (_plain_file(s), _project(s)), 1, "did not write"),
    ("train-shards-without-data", "train", ["--preset", "baseline", "--out", "{s}/new", "--shards", "{s}/t", *TINY_TRAIN],
     None, 2, "only applies with --data"),
    ("train-bf16-on-cpu", "train", ["--preset", "baseline", "--out", "{s}/new", "--dtype", "bf16", *TINY_TRAIN],
     None, 2, "bf16 autocast is for CUDA"),
    ("train-batch-not-a-multiple-of-grad-accum", "train", ["--preset", "baseline", "--out", "{s}/new", "--grad-accum",
                                                           "3", *TINY_TRAIN], None, 2, "expected a multiple of"),
    ("train-grad-accum-zero", "train", ["--preset", "baseline", "--out", "{s}/new", "--grad-accum", "0", *TINY_TRAIN],
     None, 2, "--grad-accum"),
    ("train-tokenizer-not-a-tokenizer", "train", ["--preset", "baseline", "--out", "{s}/new", "--tokenizer", "{s}/X",
                                                  *TINY_TRAIN], lambda s, fx: _plain_file(s), 1, "expected a tokenizers"),
    ("train-resume-new-dtype", "train", ["--out", "{s}/run", "--resume", "--dtype", "bf16"],
     lambda s, fx: copy_tree(fx["run"], s / "run"), 2, "drop --dtype"),
    ("shards-over-users-folder", "train.shards", ["{s}/X", "--out", "{s}/project"],
     lambda s, fx: (_plain_file(s), _project(s)), 1, "did not write"),
    ("shards-over-training-run", "train.shards", ["{s}/X", "--out", "{s}/run"],
     lambda s, fx: (_plain_file(s), copy_tree(fx["run"], s / "run")), 1, "holds a training-run"),
    ("shards-source-missing", "train.shards", ["{s}/nope", "--out", "{s}/t"], None, 1, "not found"),
    ("shards-too-few-stories", "train.shards", ["{s}/X", "--out", "{s}/t", "--quiet"],
     lambda s, fx: _plain_file(s), 1, "expected at least 3"),
    # with its progress bar: the one error line, no bar before it (the fuzz test found that)
    ("shards-too-few-stories-bar", "train.shards", ["{s}/X", "--out", "{s}/t"],
     lambda s, fx: _plain_file(s), 1, "expected at least 3"),
    ("shards-tiny-shard-size", "train.shards", ["{s}/X", "--out", "{s}/t", "--shard-tokens", "10"], None, 2,
     "--shard-tokens"),
    # --- bring your own model (issue 11) -----------------------------------------------------------------
    ("convert-unsupported-model-type", "models.convert", ["{s}/hfc", "--out", "{s}/ck"],
     lambda s, fx: _hf_config_only(s, "bert"), 1, "model_type 'bert' is not supported; supported: gpt2, llama"),
    ("build-unsupported-model-type", "export.build", ["--checkpoint", "{s}/hfc", "--out", "{s}/b"],
     lambda s, fx: _hf_config_only(s, "t5"), 1, "model_type 't5' is not supported"),
    ("convert-missing-weights", "models.convert", ["{s}/hfc", "--out", "{s}/ck"],
     lambda s, fx: _hf_config_only(s), 1, "no weights found; expected model.safetensors"),
    ("build-missing-weights", "export.build", ["--checkpoint", "{s}/hfc", "--out", "{s}/b"],
     lambda s, fx: _hf_config_only(s), 1, "no weights found"),
    ("convert-shape-mismatch-in-a-shard", "models.convert", ["{s}/hfs", "--out", "{s}/ck"],
     lambda s, fx: _hf_sharded_with_bad_shard(s), 1, "has shape [3, 5]; config.json implies"),
    ("convert-garbage-pytorch-bin", "models.convert", ["{s}/hfc", "--out", "{s}/ck"],
     lambda s, fx: (_hf_config_only(s) / "pytorch_model.bin").write_bytes(os.urandom(256)), 1,
     "not a readable PyTorch weights file"),
    ("convert-over-users-project", "models.convert", ["{s}/hfs", "--out", "{s}/project"],
     lambda s, fx: (_hf_sharded_with_bad_shard(s), _project(s)), 1, "did not write"),
    ("generate-ort-tokenizer-less-build", "runtime.generate", ["--model", "{s}/b", "--prompt", "hi"],
     lambda s, fx: _tokenizer_less(s, fx["build"]), 1, "tokenizer"),
    ("generate-torch-tokenizer-less-checkpoint", "runtime.generate",
     ["--model", "{s}/ck", "--backend", "torch", "--prompt", "hi"],
     lambda s, fx: _tokenizer_less(s, fx["build"]), 1, "converted from a folder without one"),
    ("checkpoint-is-an-hf-folder", "models.checkpoint", ["{s}/hfc"],
     lambda s, fx: _hf_config_only(s), 1, "a Hugging Face model folder (model_type 'gpt2'), not a checkpoint"),
    ("finetune-over-hf-folder", "train.finetune", ["--from", "{run}", "--method", "vanilla", "--out", "{s}/hf"],
     lambda s, fx: _hf_folder(s), 1, "did not write"),
    ("finetune-from-taper-checkpoint", "train.finetune", ["--from", "{ckpt}", "--method", "all-taper", "--out", "{s}/o"],
     None, 1, "starts from a model with real LayerNorms or RMSNorms"),
    ("finetune-from-itself", "train.finetune", ["--from", "{s}/r", "--method", "vanilla", "--out", "{s}/r"],
     lambda s, fx: copy_tree(fx["run"], s / "r"), 1, "own input"),
    ("finetune-bf16-on-cpu", "train.finetune", ["--from", "{run}", "--method", "vanilla", "--out", "{s}/o", "--dtype",
                                               "bf16"], None, 2, "bf16 autocast is for CUDA"),
    ("finetune-resume-new-dtype", "train.finetune", ["--out", "{s}/run", "--resume", "--dtype", "bf16"],
     lambda s, fx: copy_tree(fx["run"], s / "run"), 2, "drop --dtype"),
    # --- an output inside one of the command's input folders: refused, naming both ------------------------
    ("convert-into-its-hf-folder", "models.convert", ["{s}/hf", "--out", "{s}/hf/ckpt"],
     lambda s, fx: _hf_gpt2(s), 1, "is inside the command's input"),
    ("build-into-its-checkpoint", "export.build", ["--checkpoint", "{s}/ck", "--out", "{s}/ck/build"],
     lambda s, fx: copy_tree(fx["ckpt"], s / "ck"), 1, "is inside the command's input"),
    ("build-triton-repo-into-its-build", "export.build",
     ["--checkpoint", "{ckpt}", "--out", "{s}/b", "--triton-repo", "{s}/b/repo"], None, 1,
     "is inside the command's input"),
    ("triton-repo-into-its-build", "runtime.triton", ["repo", "--build", "{s}/b", "--out", "{s}/b/repo"],
     lambda s, fx: copy_tree(fx["build"], s / "b"), 1, "is inside the command's input"),
    ("finetune-into-its-source", "train.finetune", ["--from", "{s}/r", "--method", "vanilla", "--out", "{s}/r/ft",
                                                    *TINY_TRAIN[6:]],
     lambda s, fx: copy_tree(fx["run"], s / "r"), 1, "is inside the command's input"),
    ("train-into-its-data-folder", "train", ["--preset", "baseline", "--out", "{s}/texts/run", "--data", "{s}/texts",
                                             *TINY_TRAIN], lambda s, fx: _text_folder(s), 1,
     "is inside the command's input"),
    ("shards-into-its-source-folder", "train.shards", ["{s}/texts", "--out", "{s}/texts/t", "--quiet"],
     lambda s, fx: _text_folder(s), 1, "is inside the command's input"),
    ("slots-json-into-its-build", "bench.slots", ["--model", "{s}/b", "--json", "{s}/b/slots.json", "--prompt", "8",
                                                "--slots", "2", "--rounds", "3", "--threads", "1"],
     lambda s, fx: copy_tree(fx["build"], s / "b"), 1, "is inside the command's input"),
    # --- a wrong command line exits 2 whatever the files hold (README, "Errors"): options that cannot go
    # together, and values no input makes right -----------------------------------------------------------
    ("train-resume-with-run-flags", "train", ["--out", "{s}/run", "--resume", "--steps", "10", "--lr", "0.1"],
     lambda s, fx: copy_tree(fx["run"], s / "run"), 2, "drop --lr, --steps"),
    ("finetune-resume-with-run-flags", "train.finetune", ["--out", "{s}/run", "--resume", "--steps", "10"],
     lambda s, fx: copy_tree(fx["run"], s / "run"), 2, "drop --steps"),
    ("finetune-fakeln-every-without-fakeln", "train.finetune",
     ["--from", "{run}", "--method", "vanilla", "--out", "{s}/o", "--fakeln-every", "3"], None, 2, "--fakeln-every"),
    ("finetune-taper-steps-without-taper", "train.finetune",
     ["--from", "{run}", "--method", "vanilla", "--out", "{s}/o", "--taper-steps", "3"], None, 2, "--taper-steps"),
    ("train-data-with-tokenizer-train", "train", ["--preset", "baseline", "--out", "{s}/new", "--data", "{s}/X",
                                                  "--tokenizer", "train", *TINY_TRAIN],
     lambda s, fx: _plain_file(s), 2, "--tokenizer train"),
    ("train-aux-lambda-without-taper", "train", ["--preset", "baseline", "--out", "{s}/new", "--aux-lambda", "0.1",
                                                 *TINY_TRAIN], None, 2, "drop --aux-lambda"),
    ("train-seq-len-over-max-seq-len", "train", ["--preset", "baseline", "--out", "{s}/new", "--max-seq-len", "8",
                                                 *TINY_TRAIN], None, 2, "--seq-len 16"),
    ("train-shards-inside-out", "train", ["--preset", "baseline", "--out", "{s}/new", "--data", "{s}/X", "--shards",
                                          "{s}/new/t", *TINY_TRAIN], lambda s, fx: _plain_file(s), 2, "inside --out"),
    ("build-int8-layers-with-int8", "export.build",
     ["--fuse", "--checkpoint", "{ckpt}", "--out", "{s}/b", "--quantize", "int8", "--int8-layers", "v_proj"], None, 2,
     "--int8-layers"),
    ("generate-prompt-and-batch-file", "runtime.generate",
     ["--model", "{build}", "--prompt", "hi", "--batch-file", "{s}/X"], lambda s, fx: _plain_file(s), 2, "found both"),
    ("generate-neither-prompt-nor-batch-file", "runtime.generate", ["--model", "{build}"], None, 2, "found neither"),
    ("generate-top-p-zero", "runtime.generate", ["--model", "{build}", "--prompt", "hi", "--top-p", "0"], None, 2,
     "sampling"),
    # --- issue 42 item 8: each message names what the user wrote (their field, tensor, option) and the fix -----
    ("convert-final-softcap-inf", "models.convert", ["{s}/hfc", "--out", "{s}/ck"],
     lambda s, fx: _hf_family_config(s, "gemma2", final_logit_softcapping=float("inf")), 1,
     "config.json: gemma2 field 'final_logit_softcapping' is inf; expected null or a finite positive number; "
     "correct final_logit_softcapping in config.json"),
    ("convert-local-rope-theta-inf", "models.convert", ["{s}/hfc", "--out", "{s}/ck"],
     lambda s, fx: _hf_family_config(s, "gemma3", rope_parameters={
         "sliding_attention": {"rope_type": "default", "rope_theta": float("inf")},
         "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}), 1,
     "gemma3_text field 'rope_parameters.sliding_attention.rope_theta' is inf; expected null or a finite positive "
     "number; correct rope_parameters.sliding_attention.rope_theta in config.json"),
    ("convert-attn-scale-from-query-pre-attn-scalar", "models.convert", ["{s}/hfc", "--out", "{s}/ck"],
     lambda s, fx: _hf_family_config(s, "gemma2", query_pre_attn_scalar=float("inf")), 1,
     "gemma2 field 'query_pre_attn_scalar' is inf, which gives the decoder's attn_scale = 0.0; expected attn_scale "
     "null or a finite positive number; correct query_pre_attn_scalar in config.json"),
    ("convert-logits-divisor-inf", "models.convert", ["{s}/hfc", "--out", "{s}/ck"],
     lambda s, fx: _hf_family_config(s, "granite", logits_scaling=float("inf")), 1,
     "granite field 'logits_scaling' is inf; expected a finite positive number; correct logits_scaling in config.json"),
    ("build-hf-tensor-nan-named-as-in-the-file", "export.build", ["--checkpoint", "{s}/hf", "--out", "{s}/b"],
     lambda s, fx: _hf_llama_with_nan(s), 1,
     "model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' contains NaN or Inf"),
    ("build-triton-repo-over-plain-file", "export.build",
     ["--checkpoint", "{ckpt}", "--out", "{s}/b", "--triton-repo", "{s}/X"], lambda s, fx: _plain_file(s), 1,
     "X: expected a Triton model repository or a new path, found a file; choose another --triton-repo"),
    ("fold-vs-genai-work-is-a-file", "bench.fold_vs_genai",
     ["run", "--shape", "qwen3-0.6b", "--work", "{s}/X", "--json", "{s}/r.json"], lambda s, fx: _plain_file(s), 1,
     "X: expected a folder for the run's builds, found a file; choose another --work"),
    ("fold-vs-genai-empty-shape-list", "bench.fold_vs_genai",
     ["run", "--shape", ",", "--work", "{s}/w", "--json", "{s}/r.json"], None, 2,
     "error: --shape ',': expected one or more bench/shapes.py names or config .json paths, comma-separated, "
     "found none; pass e.g. --shape qwen3-0.6b"),
    ("train-rope-odd-head-width", "train", ["--preset", "baseline", "--out", "{s}/new", "--arch", "gemma3",
                                            "--d-model", "60", "--n-head", "4", *TINY_TRAIN[2:4], *TINY_TRAIN[6:]],
     None, 2,
     "error: --d-model 60 / --n-head 4: expected an even head width for rope (--arch llama, qwen3, gemma3 rotate "
     "pairs of dims), found 15; change --d-model or --n-head (e.g. --d-model 64)"),
    ("build-int4-weight-3e38", "export.build",
     ["--fuse", "--quantize", "int4", "--checkpoint", "{s}/huge", "--out", "{s}/b"],
     lambda s, fx: _ckpt_with_huge_weight(s), 1,
     "blocks.0.attn.qkv_proj: expected finite weights of magnitude <= 1.84e+19 to quantize to int4, found |w| up "
     "to 2.92e+38"),
]


def _cli(command: str, argv: list):
    """tests.cli.conftest.cli, and bench.fold_vs_genai (not among the fuzzed COMMANDS: its `run` builds real shapes)."""
    if command in COMMANDS:
        return cli(command, argv)
    import contextlib
    import importlib
    import io
    from tests.cli.conftest import Result
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = importlib.import_module(command).main([str(a) for a in argv])
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def fx(tiny_ckpt, tiny_build, tiny_unfused_build, tiny_run):
    return {"ckpt": tiny_ckpt, "build": tiny_build, "unfused": tiny_unfused_build, "run": tiny_run}


@pytest.fixture(scope="module")
def ports():
    garbage = _Garbage()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    yield {"garbage_port": garbage.port, "closed_port": closed}
    garbage.close()


@pytest.mark.parametrize("case_id, command, argv, setup, code, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_nothing_changed(tmp_path, fx, ports, case_id, command, argv, setup, code, needle):
    s = tmp_path / "s"
    s.mkdir()
    if setup is not None:
        setup(s, fx)
    before = snapshot(tmp_path)
    args = [a.format(s=s, ckpt=fx["ckpt"], build=fx["build"], unfused=fx["unfused"], run=fx["run"], **ports)
            for a in argv]
    r = _cli(command, args)
    assert "Traceback" not in r.err, r.err
    assert r.code == code, (r.code, r.err)
    assert len(r.error_lines) == 1 and r.err.startswith("error: "), r.err
    assert needle in r.error_lines[0], r.error_lines[0]
    assert snapshot(tmp_path) == before


def test_unreadable_config_and_weights_are_named(tmp_path, fx, monkeypatch):
    """Permission denied (simulated: the tests may run as root, which reads anything)."""
    ck = copy_tree(fx["ckpt"], tmp_path / "ck")
    real = Path.read_bytes

    def deny(self):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)
    with monkeypatch.context() as m:
        m.setattr(Path, "read_bytes", deny)
        r = cli("models.checkpoint", [ck])
    assert r.code == 1 and r.error_lines == [r.err.strip()] and "config.json: expected a readable file, found permission denied" in r.err
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).endswith("model.safetensors") else real_access(p, mode))
    r = cli("models.checkpoint", [ck])
    assert r.code == 1 and "model.safetensors: expected a readable file, found permission denied" in r.err


def test_replacing_our_own_build_keeps_the_users_dot_old_and_gives_readable_modes(tmp_path, fx):
    out = copy_tree(fx["build"], tmp_path / "b")
    mine = tmp_path / ".b.old"
    mine.mkdir()
    (mine / "keep.txt").write_text("the user's")
    old = os.umask(0o022)
    try:
        r = cli("runtime.triton", ["repo", "--build", out, "--out", tmp_path / "repo"])
        assert r.code == 0, r.err
        r = cli("runtime.triton", ["repo", "--build", out, "--out", tmp_path / "repo"])   # ours: replaced
        assert r.code == 0, r.err
    finally:
        os.umask(old)
    assert (mine / "keep.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".b.old", "b", "repo"]
    for p in [tmp_path / "repo", *(tmp_path / "repo").rglob("*")]:
        if p.is_dir():
            assert p.stat().st_mode & 0o777 == 0o755, p
        elif p.stat().st_nlink == 1:        # hard links share the build's own file
            assert p.stat().st_mode & 0o777 == 0o644, p


def test_broadcasting_mul_is_not_folded_and_the_graph_stays_loadable(tmp_path):
    """x[B, 1] * s[4] -> MatMul W[4, 3]: folding s into W would drop the broadcast."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    s = numpy_helper.from_array(np.array([1.0, 2.0, 3.0, 4.0], np.float32), "s")
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    g = helper.make_graph([helper.make_node("Mul", ["x", "s"], ["h"], name="scale"),
                           helper.make_node("MatMul", ["h", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3])], [s, w])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), src)
    r = cli("graph_passes", [src, "-o", tmp_path / "o.onnx"])
    assert r.code == 0, r.err
    assert "channel_scale: 0 folded, 1 skipped" in r.out and "not a per-channel scale" in r.out
    x = np.array([[2.0], [3.0]], np.float32)
    ref = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(tmp_path / "o.onnx")).run(None, {"x": x})[0]
    np.testing.assert_array_equal(ref, got)


def test_build_triton_repo_on_a_full_disk_names_the_build_it_wrote(tmp_path, fx, small_fs):
    """export.build --triton-repo on a full file system: the build at --out was written whole, so the one
    line says so and points the fix at --triton-repo (the child runtime.triton repo said "nothing was
    written ... choose another --out")."""
    import re
    fs = small_fs.mount("16m")
    small_fs.fill(fs, 4096)
    out, repo = tmp_path / "b", fs / "repo"
    r = cli("export.build", ["--checkpoint", fx["ckpt"], "--out", out, "--triton-repo", repo])
    assert r.code == 1 and "Traceback" not in r.err and len(r.error_lines) == 1, r.err[-3000:]
    assert re.fullmatch(rf"error: {re.escape(str(repo))}(/[^:]+)?: No space left on device; complete: "
                        rf"{re.escape(str(out))}; nothing else was written \(free space or choose another "
                        r"--triton-repo\)", r.error_lines[0]), r.error_lines[0]
    assert (out / "model.onnx").is_file() and not repo.exists()
