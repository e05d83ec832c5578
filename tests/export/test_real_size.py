"""export.build at real sizes: memory known before any work (export.memory.build_memory), a build that
cannot fit refused in one line naming an option that fits (cheaper_option, core.inputs.check_memory), and
the peak resident memory of real builds within the estimate and the issue's bound.

The one route reads each weight when it is written and runs the reference block by block, so a build's
peak is the largest of its stages, each alone, not the model's size in memory. That the route's graph is
right is tests/export/test_build_oracle.py's (against torch's export) and the build's own verification's.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from export.quantize import QuantConfig

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"
REPO = Path(__file__).resolve().parents[2]
# Llama-3-8B's shape
LLAMA_8B = dict(vocab_size=128256, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, mlp="swiglu", mlp_hidden=14336,
                pos_embedding="rope", tie_embeddings=False)


def test_a_build_that_cannot_fit_is_refused_in_one_line_and_writes_nothing(tmp_path, monkeypatch):
    from core.errors import UserError
    from export.options import BuildOptions
    from export.pipeline import build
    monkeypatch.setattr("core.inputs.available_memory", lambda: 256 << 20)
    lines = []
    with pytest.raises(UserError) as e:
        build(ZOO / "internal-taper", tmp_path / "out", BuildOptions(True), log=lines.append)
    msg = str(e.value)
    assert "\n" not in msg and "needs ~" in msg and "available" in msg and "use a machine with more memory" in msg
    assert lines == []                                                  # refused before the first stage
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_refused_build_names_the_option_that_fits(tmp_path, monkeypatch):
    """Memory between the int4 build's estimate and the fp32 one's: the fp32 build is refused, and its line
    names --quantize int4, which the same memory then builds."""
    from core.errors import UserError
    from export.memory import build_memory
    from export.options import BuildOptions
    from export.pipeline import build
    from models.weights import open_weights
    cfg = open_weights(ZOO / "internal-taper").cfg
    fp32, int4 = build_memory(cfg, "fp32", None), build_memory(cfg, "fp32", QuantConfig("int4"))
    assert int4.peak < fp32.peak
    monkeypatch.setattr("core.inputs.available_memory", lambda: (int4.peak + fp32.peak) // 2)
    with pytest.raises(UserError, match=r"needs ~.*; build with --quantize int4 \(needs ~") as e:
        build(ZOO / "internal-taper", tmp_path / "out", BuildOptions(True), log=lambda *a: None)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    report = build(ZOO / "internal-taper", tmp_path / "out", BuildOptions(True, quantize=QuantConfig("int4")),
                   log=lambda *a: None)
    assert report.memory_estimate.peak == int4.peak and (tmp_path / "out" / "model.int4.onnx").is_file()


def test_the_refusal_names_an_option_that_fits(monkeypatch):
    from export.memory import build_memory, cheaper_option
    from models.decoder import DecoderConfig
    cfg = DecoderConfig(**LLAMA_8B)
    fp32, int4 = build_memory(cfg, "fp32", None), build_memory(cfg, "fp32", QuantConfig("int4"))
    int8, fp16 = build_memory(cfg, "fp32", QuantConfig("int8")), build_memory(cfg, "fp16", None)
    assert int4.peak < int8.peak < fp32.peak and fp16.peak < fp32.peak
    monkeypatch.setattr("core.inputs.available_memory", lambda: (int4.peak + fp32.peak) // 2)
    assert cheaper_option(cfg, "fp32", None).startswith("build with --quantize int4")
    assert cheaper_option(cfg, "fp32", QuantConfig("int8")).startswith("build with --quantize int4")
    monkeypatch.setattr("core.inputs.available_memory", lambda: int4.peak - 1)        # nothing fits
    assert cheaper_option(cfg, "fp32", None) == "use a machine with more memory"


def test_the_estimate_counts_the_verifications_caches_at_full_capacity():
    """A verification step holds its caches in and out at the model's capacity (VERIFY_BATCH rows): Qwen3-0.6B's
    shape at 8448 tokens, 3.9 GB a set, is in ONNX Runtime's part of the estimate twice; at 256 tokens 30x less."""
    from export.memory import VERIFY_BATCH, build_memory, cache_bytes
    from models.decoder import DecoderConfig
    qwen = dict(vocab_size=151936, d_model=1024, n_layer=28, n_head=16, n_kv_head=8, head_size=128, mlp="swiglu",
                mlp_hidden=3072, pos_embedding="rope")
    long, short = DecoderConfig(**qwen, max_seq_len=8448), DecoderConfig(**qwen, max_seq_len=256)
    assert cache_bytes(long, "fp32", VERIFY_BATCH) == 2 * 28 * 2 * 8 * 8448 * 128 * 4 == 3_875_536_896
    assert cache_bytes(long, "fp16", 1) * 4 == cache_bytes(long, "bf16", 2)
    q = QuantConfig("int4")
    grown = build_memory(long, "fp32", q).parts["ONNX Runtime over the graph"] - \
        build_memory(short, "fp32", q).parts["ONNX Runtime over the graph"]
    assert grown == 2 * (cache_bytes(long, "fp32", VERIFY_BATCH) - cache_bytes(short, "fp32", VERIFY_BATCH))
    assert build_memory(long, "fp32", q).peak > 8.3 * 2**30          # what that build measured (docs/export.md)


@pytest.mark.slow
def test_a_long_capacity_build_stays_within_its_estimate(tmp_path):
    """The zoo's Qwen3 (232K parameters) at a capacity of 1,048,576 tokens, the GroupQueryAttention graph: its
    caches (2 GiB a set of 2 rows) are most of the peak, which passes the estimate without them (BASE_BYTES)
    and stays under the estimate with them."""
    from export.memory import BASE_BYTES
    peak = _peak_of_build(ZOO / "qwen3", tmp_path / "build", "--target", "ort-cpu", "--max-seq-len", "1048576")
    estimate = json.loads((tmp_path / "build" / "report.json").read_text())["memory_estimate"]
    assert BASE_BYTES < peak <= estimate["peak_bytes"], (peak, estimate)


def _peak_of_build(folder: Path, out: Path, *args: str) -> int:
    """Peak resident bytes of `export.build --fuse` on `folder`, run under a fresh parent so that
    RUSAGE_CHILDREN is this build's alone."""
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "export.build", "--fuse",
                           "--checkpoint", str(folder), "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1]) * 1024           # KiB on Linux


def _weight_bytes(build: Path, graph: str = "model.fused.onnx") -> int:
    return sum(p.stat().st_size for p in build.iterdir() if p.name.startswith(graph))


def test_a_100m_build_peak_memory_stays_under_its_bound(tmp_path):
    """A ~100M-parameter Llama-shaped folder (bf16, written tensor by tensor) built: its peak resident
    memory stays under 1.2 x the written weights + 3 GB, the issue's bound, and under the peak the build
    estimated before it started (report.json memory_estimate: what its refusal is decided on)."""
    from bench.shapes import SHAPES, write_random_folder
    config = dict(SHAPES["llama-3.2-1b"], hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32000)
    folder = write_random_folder(config, tmp_path / "m100", log=lambda *a: None)
    peak = _peak_of_build(folder, tmp_path / "build")
    report = json.loads((tmp_path / "build" / "report.json").read_text())
    assert 90e6 < report["model"]["params"] < 130e6
    assert report["weight_bytes"] > 4 * 90e6 and _weight_bytes(tmp_path / "build") >= report["weight_bytes"]
    assert 0 < peak <= 1.2 * _weight_bytes(tmp_path / "build") + 3e9, peak
    assert peak <= report["memory_estimate"]["peak_bytes"], (peak, report["memory_estimate"])


@pytest.mark.slow
def test_gpt2_medium_shape_builds_within_its_bound(tmp_path):
    """GPT-2 medium's shape (355M; the old in-memory build was OOM-killed at 24 GB): within 1.2 x its
    weight bytes + 3 GB and its own estimate."""
    from bench.shapes import write_random_folder
    folder = write_random_folder("gpt2-medium", tmp_path / "gpt2-medium", log=lambda *a: None)
    peak = _peak_of_build(folder, tmp_path / "build")
    assert 0 < peak <= 1.2 * _weight_bytes(tmp_path / "build") + 3e9, peak
    report = json.loads((tmp_path / "build" / "report.json").read_text())
    assert peak <= report["memory_estimate"]["peak_bytes"], (peak, report["memory_estimate"])
