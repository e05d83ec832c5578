"""python -m runtime.generate: text on stdout, metrics on stderr, one-line errors with a non-zero exit."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.runtime.conftest import REPO


def cli(*args, env_extra=None, pythonpath_first=None):
    env = dict(os.environ)
    if pythonpath_first:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath_first), str(REPO)])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "runtime.generate", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for f in fragments:
        assert f in lines[0], lines[0]


def test_ort_build_and_torch_checkpoint_print_the_same_text(tiny):
    ckpt, build = tiny
    common = ["--prompt", "Once upon a time", "--max-new-tokens", "16", "--ignore-eos"]
    o = cli("--model", build, "--backend", "ort", *common)
    t = cli("--model", ckpt, "--backend", "torch", *common)
    assert o.returncode == 0 and t.returncode == 0, o.stderr + t.stderr
    assert o.stdout == t.stdout and o.stdout.strip()
    for metric in ("TTFT", "TPOT p50", "tokens/s"):
        assert metric in o.stderr.splitlines()[-1]


def test_batch_file_prints_one_line_per_prompt(tiny, tmp_path):
    _, build = tiny
    f = tmp_path / "prompts.txt"
    f.write_text("Once upon a time\nTom liked\nThe sun was warm and the birds\nLily\n")
    proc = cli("--model", build, "--batch-file", f, "--max-new-tokens", "6", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 4 and "batch 4" in proc.stderr


def test_model_may_be_an_onnx_file(tiny):
    _, build = tiny
    proc = cli("--model", build / "model.onnx", "--prompt", "Tom", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr


def test_prompt_longer_than_the_cache(tiny):
    _, build = tiny
    assert_one_line_error(cli("--model", build, "--prompt", "Once upon a time there was a cat. " * 20),
                          "prompt", "at most 48 tokens")


def test_max_new_tokens_past_capacity(tiny):
    _, build = tiny
    assert_one_line_error(cli("--model", build, "--prompt", "Tom", "--max-new-tokens", "100"),
                          "max-new-tokens", "capacity", "or less")


def test_missing_model(tmp_path):
    assert_one_line_error(cli("--model", tmp_path / "nope", "--prompt", "Tom"), "nope", "export.build")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(cli("--model", tmp_path / "empty", "--prompt", "Tom"), "model.fused.onnx")
    assert_one_line_error(cli("--model", tmp_path / "nope", "--backend", "torch", "--prompt", "Tom"), "nope")


def test_corrupt_model(tiny, tmp_path):
    ckpt, build = tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copyfile(build / "tokenizer.json", bad / "tokenizer.json")
    (bad / "model.onnx").write_bytes(b"\x08\x07garbage, not a protobuf")
    assert_one_line_error(cli("--model", bad, "--prompt", "Tom"), "model.onnx", "ONNX")
    badck = tmp_path / "badck"
    shutil.copytree(ckpt, badck)
    (badck / "model.safetensors").write_bytes(b"not safetensors")
    assert_one_line_error(cli("--model", badck, "--backend", "torch", "--prompt", "Tom"), "model.safetensors")


def test_trt_without_the_extra_names_it(tiny, tmp_path):
    """A tensorrt that fails to import (as when the extra is missing) gives the install line."""
    _, build = tiny
    stub = tmp_path / "stub"
    (stub / "tensorrt").mkdir(parents=True)
    (stub / "tensorrt" / "__init__.py").write_text("raise ImportError('libnvinfer.so.11: cannot open shared object file')\n")
    assert_one_line_error(cli("--model", build, "--backend", "trt", "--prompt", "Tom", pythonpath_first=stub),
                          "backend 'trt'", "tensorrt extra", "pip install 'tapernorm-deploy[tensorrt]'")


def test_trt_without_a_cuda_device(tiny, tmp_path):
    """tensorrt importable but no CUDA device (hidden with CUDA_VISIBLE_DEVICES='')."""
    _, build = tiny
    stub = tmp_path / "stub"
    (stub / "tensorrt").mkdir(parents=True)
    (stub / "tensorrt" / "__init__.py").write_text("__version__ = '11.0.0'\n")
    assert_one_line_error(cli("--model", build, "--backend", "trt", "--prompt", "Tom", pythonpath_first=stub,
                              env_extra={"CUDA_VISIBLE_DEVICES": ""}),
                          "backend 'trt'", "CUDA device", "--backend ort")


def test_ort_cuda_without_onnxruntime_gpu(tiny):
    import onnxruntime
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    _, build = tiny
    assert_one_line_error(cli("--model", build, "--device", "cuda", "--prompt", "Tom"),
                          "gpu extra", "pip install 'tapernorm-deploy[gpu]'")


def test_seeded_sampling_prints_the_same_text_run_to_run(tiny):
    _, build = tiny
    args = ["--model", build, "--prompt", "Once upon a time", "--max-new-tokens", "24", "--ignore-eos",
            "--temperature", "1.0", "--top-k", "50", "--top-p", "0.95"]
    a, b, c = cli(*args, "--seed", "5"), cli(*args, "--seed", "5"), cli(*args, "--seed", "6")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout != c.stdout


def test_a_quantized_build_runs_its_quantized_graph_in_onnx_runtime(tmp_path, tiny):
    """A folder holding model.fused.onnx and model.int4.onnx (a --quantize build holds the int4 graph alone; a
    fused build's folder may get one put beside it): ONNX Runtime given the folder runs the int4 graph (what
    the user built to run), TensorRT's order keeps the portable fused graph first, and runtime.generate says
    on stderr which graph ran."""
    from runtime.model_files import resolve_onnx
    from runtime.ort_session import OrtSession
    both = tmp_path / "both"
    both.mkdir()
    for name in ("model.fused.onnx", "model.int4.onnx"):
        (both / name).write_bytes(b"")
    assert OrtSession(both).path.name == "model.int4.onnx"
    assert resolve_onnx(both).name == "model.fused.onnx"                # the TensorRT session's order
    _, build = tiny
    o = cli("--model", build, "--prompt", "Once", "--max-new-tokens", "2")
    assert o.returncode == 0 and o.stderr.splitlines()[-1].startswith("ort model.onnx: "), o.stderr   # (tiny: one graph)


def test_stop_strings_cut_the_text_and_logprobs_go_to_stderr(tiny, tmp_path):
    """--stop TEXT (repeatable) ends the text just before the first stop string, in a batch too (each line
    on its own); --logprobs K prints one line per new token on stderr: its logprob and the K most likely."""
    _, build = tiny
    common = ["--model", build, "--max-new-tokens", "16", "--frequency-penalty", "1.5", "--presence-penalty", "0.5"]
    free = cli(*common, "--prompt", "Once upon a time")
    assert free.returncode == 0, free.stderr
    text = free.stdout.rstrip("\n")
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1)
                if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    cut = cli(*common, "--prompt", "Once upon a time", "--stop", "§never", "--stop", stop, "--logprobs", "2")
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout == text[:text.find(stop)] + "\n"
    lines = [ln for ln in cut.stderr.splitlines() if ln.startswith("logprobs ")]
    assert lines and lines[0].startswith("logprobs 0: ") and " | top: " in lines[0] and len(lines) < 16
    f = tmp_path / "prompts.txt"
    f.write_text("Once upon a time\nTom liked\n")
    batch = cli(*common, "--batch-file", f, "--stop", stop)
    assert batch.returncode == 0 and batch.stdout.splitlines()[0] == text[:text.find(stop)].replace("\n", "\\n")
    assert_one_line_error(cli(*common, "--prompt", "Tom", "--stop", "id:x"), "--stop 'id:x'", "id:N")
