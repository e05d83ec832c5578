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
