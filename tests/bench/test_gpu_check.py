"""bench/gpu_check.sh without a GPU: every GPU part says why it skipped, the run exits 0 and the
archive holds every log; the install part, dry-run, installs each extra in its own pip call."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
GPU_PARTS = ("torch_decode", "families_decode", "pytest_gpu", "trt_tests", "trt_bench")


def gpu_check(out: Path, **env) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Run the script with OUT=out; returns the process and summary lines by part name."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full.update({"OUT": str(out), "PYTHON": sys.executable, **env})
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)
    summary = (out / "gpu_check_summary.txt").read_text() if (out / "gpu_check_summary.txt").is_file() else ""
    parts = {line.split()[0]: line.split(None, 1)[1] for line in summary.splitlines()[1:] if line.strip()}
    return proc, parts


def archived(out: Path) -> dict[str, str]:
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="a CUDA device is visible: the GPU parts would run here, not skip")
def test_without_a_gpu_every_gpu_part_skips_with_its_reason(tmp_path):
    out = tmp_path / "out"
    proc, parts = gpu_check(out, GPU_CHECK_SKIP_INSTALL="1",
                            GPU_CHECK_PARTS="install probe torch_decode families_decode pytest_gpu trt_tests trt_bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert parts["install"].startswith("skipped: GPU_CHECK_SKIP_INSTALL is set")
    assert parts["probe"].startswith("ok")
    for name in GPU_PARTS:
        assert parts[name].startswith("skipped: torch sees no CUDA device"), (name, parts[name])
    logs = archived(out)
    assert {f"gpu_check/{n}.log" for n in ("install", "probe", *GPU_PARTS)} <= set(logs)
    assert "onnxruntime providers" in logs["gpu_check/probe.log"]
    assert "no part failed" in logs["gpu_check/summary.txt"]


def test_a_python_without_torch_skips_too(tmp_path):
    """PYTHON may be any interpreter: one without torch is a reason, not a failure."""
    fake = tmp_path / "python-no-torch"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I \"$@\"\n")     # -I -S: no site-packages, no torch
    fake.chmod(0o755)
    proc, parts = gpu_check(tmp_path / "out", PYTHON=str(fake), GPU_CHECK_SKIP_INSTALL="1",
                            GPU_CHECK_PARTS="torch_decode trt_tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert parts["torch_decode"].startswith("skipped: torch is not importable")
    assert parts["trt_tests"].startswith("skipped: torch is not importable")


def test_install_dry_run_installs_each_extra_alone_with_torch_pinned(tmp_path):
    out = tmp_path / "out"
    proc, parts = gpu_check(out, GPU_CHECK_PARTS="install", GPU_CHECK_ONLINE="1", GPU_CHECK_DRY_RUN="1",
                            GPU_CHECK_WHEELS=str(tmp_path / "none"))
    assert proc.returncode == 0 and parts["install"].startswith("ok"), proc.stdout + proc.stderr
    log = archived(out)["gpu_check/install.log"]
    calls = [line for line in log.splitlines() if line.startswith("would run:")]
    assert len(calls) == 4, log                                    # base, dev, gpu, tensorrt: one pip call each
    assert all(" -m pip install " in c and " -c " in c for c in calls)     # torch pinned by a constraints file
    assert not any(" -e " in c or "torch==" in c for c in calls)   # the project itself is never pip-installed
    trt = [c for c in calls if "tensorrt>=" in c]
    assert len(trt) == 1 and "--extra-index-url https://pypi.nvidia.com" in trt[0]
    assert sum("onnxruntime-gpu" in c for c in calls) == 1 and "onnx-graphsurgeon" in calls[0]


def test_install_from_carried_wheels_is_offline(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "onnx_graphsurgeon-0.6.1-py2.py3-none-any.whl").write_bytes(b"not a real wheel: dry run")
    out = tmp_path / "out"
    proc, parts = gpu_check(out, GPU_CHECK_PARTS="install", GPU_CHECK_DRY_RUN="1", GPU_CHECK_WHEELS=str(wheels))
    assert proc.returncode == 0 and parts["install"].startswith("ok"), proc.stdout + proc.stderr
    log = archived(out)["gpu_check/install.log"]
    assert "--no-index --no-deps" in log and "onnx_graphsurgeon-0.6.1" in log


def test_out_of_time_parts_skip_and_the_archive_is_still_written(tmp_path):
    out = tmp_path / "out"
    proc, parts = gpu_check(out, GPU_CHECK_BUDGET_S="5", GPU_CHECK_PARTS="probe torch_decode")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert parts["probe"].startswith("skipped: no time left") and parts["torch_decode"].startswith("skipped: no time left")
    assert "gpu_check/summary.txt" in archived(out)
