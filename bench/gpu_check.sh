#!/usr/bin/env bash
# bench/gpu_check.sh: everything that needs a GPU, in one run, logs in one folder, under 8 minutes.
#
#   bash bench/gpu_check.sh            # logs in $OUT/gpu_check if $OUT is set, else gpu_logs/
#   GPU_LOG_DIR=/tmp/x bash bench/gpu_check.sh
#   GPU_CHECK_SKIP_INSTALL=1 PYTHON=/work/venv/bin/python bash bench/gpu_check.sh   # dry run, no pip
#
# Steps (each under `timeout`, all under one 470 s deadline; a failed step is logged and the
# script goes on, then exits non-zero naming the failed steps):
#   env      nvidia-smi, python, pip freeze
#   install  pip install -e '.[gpu,tensorrt,dev]', from ./wheels (offline) when that folder exists;
#            onnxruntime-gpu replaces the CPU onnxruntime (both install the same `onnxruntime` package)
#   probe    torch CUDA device, tensorrt version, ORT providers
#   pytest   pytest -m gpu (tests/runtime/test_trt_session.py, CUDA graphs, ORT CUDA provider, ...)
#   bench    decode step on torch CUDA (CUDA graphs): RMSNorm baseline vs norm-free (all-taper at
#            gate 0, the fused form), interleaved; ORT CUDA provider and TensorRT on the fused builds
#            when importable. Uses models/zoo/{baseline,all-taper} if present, else random models
#            of the same shape family (d 512, 8 layers, capacity 1024).
set -euo pipefail
cd "$(dirname "$0")/.."

LOG_DIR="${GPU_LOG_DIR:-${OUT:+$OUT/gpu_check}}"
LOG_DIR="${LOG_DIR:-gpu_logs}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python}"
DEADLINE=$(( $(date +%s) + 470 ))
FAILED=()
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=15

left() { echo $(( DEADLINE - $(date +%s) )); }

# step NAME LIMIT_S CMD...: run CMD with a timeout of min(LIMIT_S, time left), log to $LOG_DIR/NAME.log
step() {
    local name=$1 limit=$2; shift 2
    local budget; budget=$(left)
    (( budget < limit )) && limit=$budget
    if (( limit < 10 )); then
        echo "== $name: skipped, $(left) s left" | tee -a "$LOG_DIR/summary.log"
        FAILED+=("$name(no time)"); return 0
    fi
    local t0; t0=$(date +%s)
    if timeout --kill-after=5 "$limit" bash -c 'set -euo pipefail; "$@"' _ "$@" >"$LOG_DIR/$name.log" 2>&1; then
        echo "== $name: ok ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG_DIR/summary.log"
    else
        local rc=$?
        echo "== $name: FAILED rc=$rc ($(( $(date +%s) - t0 )) s, limit $limit s); see $LOG_DIR/$name.log" | tee -a "$LOG_DIR/summary.log"
        FAILED+=("$name")
    fi
}

env_report() {
    date -u; nvidia-smi || true; "$PY" --version; "$PY" -m pip freeze 2>/dev/null | grep -iE 'torch|onnx|tensorrt|numpy|cuda' || true
}

install() {
    if [[ -n "${GPU_CHECK_SKIP_INSTALL:-}" ]]; then echo "skipped: GPU_CHECK_SKIP_INSTALL is set"; return 0; fi
    local spec=".[gpu,tensorrt,dev]" args=()
    if [[ -d wheels ]]; then args=(--no-index --find-links wheels); fi
    "$PY" -m pip install "${args[@]}" -e "$spec" || echo "pip install of $spec failed (offline without ./wheels?); tests skip what is missing"
    # onnxruntime and onnxruntime-gpu both install the `onnxruntime` package: keep only the GPU build
    if "$PY" -m pip show onnxruntime-gpu >/dev/null 2>&1 && \
       ! "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"; then
        "$PY" -m pip uninstall -y onnxruntime onnxruntime-gpu
        "$PY" -m pip install "${args[@]}" --no-deps onnxruntime-gpu
    fi
}

probe() {
    "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
try:
    import tensorrt
    print("tensorrt", tensorrt.__version__)
except ImportError as e:
    print("tensorrt not importable:", e)
import onnxruntime
print("onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers())
EOF
}

run_pytest() {
    "$PY" -m pytest -m gpu tests -rs -q -p no:cacheprovider --junitxml="$LOG_DIR/pytest_gpu.xml"
}

make_models() {
    "$PY" - "$LOG_DIR/models" <<'EOF'
import sys
from pathlib import Path
root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
zoo = Path("models/zoo")
for name in ("baseline", "all-taper"):
    dst = root / name
    if (zoo / name / "config.json").is_file():
        (root / f"{name}.source").write_text(str(zoo / name))
        continue
    sys.path.insert(0, ".")
    from tests.helpers import random_model, write_checkpoint
    shape = dict(vocab_size=4096, d_model=512, n_layer=8, n_head=8, max_seq_len=1024, randomize_norms=False)
    if name == "baseline":
        model = random_model(seed=0, norm="rmsnorm", **shape)
    else:
        model = random_model(seed=0, norm="taper", taper_scope="all", gate=0.0, **shape)
    write_checkpoint(dst, model)
    (root / f"{name}.source").write_text(str(dst))
    print("random", name, "->", dst)
EOF
}

src() { cat "$LOG_DIR/models/$1.source"; }

has_cuda() { "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; }
has_ort_cuda() { "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"; }
has_trt() { "$PY" -c "import tensorrt" 2>/dev/null; }

bench_torch() {
    if ! has_cuda; then echo "skipped: torch sees no CUDA device"; return 0; fi
    "$PY" -m runtime.step_timing --backend torch --device cuda --model "$(src baseline)" --model "$(src all-taper)" \
        --batch 1 --prompt-len 32 --steps 200 --rounds 3
    "$PY" -m runtime.step_timing --backend torch --device cuda --model "$(src baseline)" --model "$(src all-taper)" \
        --batch 8 --prompt-len 32 --steps 200 --rounds 3
}

build_onnx() {
    if ! has_cuda || ! { has_ort_cuda || has_trt; }; then echo "skipped: neither onnxruntime-gpu nor tensorrt with CUDA"; return 0; fi
    for name in baseline all-taper; do
        "$PY" -m export.build --fuse --checkpoint "$(src $name)" --out "$LOG_DIR/builds/$name"
    done
}

bench_ort_cuda() {
    if ! has_ort_cuda; then
        echo "skipped: no CUDAExecutionProvider (onnxruntime-gpu not installed)"; return 0
    fi
    "$PY" -m runtime.step_timing --backend ort --device cuda --model "$LOG_DIR/builds/baseline" \
        --model "$LOG_DIR/builds/all-taper" --batch 1 --prompt-len 32 --steps 200 --rounds 3
}

bench_trt() {
    if ! has_trt || ! has_cuda; then echo "skipped: tensorrt not importable or no CUDA device"; return 0; fi
    "$PY" -m runtime.step_timing --backend trt --model "$LOG_DIR/builds/baseline" --model "$LOG_DIR/builds/all-taper" \
        --batch 1 --prompt-len 32 --steps 200 --rounds 3
    "$PY" -m runtime.generate --backend trt --model "$LOG_DIR/builds/all-taper" --prompt "Once upon a time" \
        --max-new-tokens 64 --ignore-eos
}

export LOG_DIR PY
export -f has_cuda has_ort_cuda has_trt env_report install probe run_pytest make_models src bench_torch build_onnx bench_ort_cuda bench_trt

echo "gpu_check: logs in $LOG_DIR" | tee "$LOG_DIR/summary.log"
step env 30 env_report
step install 200 install
step probe 60 probe
step pytest_gpu 200 run_pytest
step make_models 60 make_models
step bench_torch 90 bench_torch
step build_onnx 120 build_onnx
step bench_ort_cuda 60 bench_ort_cuda
step bench_trt 150 bench_trt

for f in bench_torch bench_ort_cuda bench_trt; do
    [[ -f "$LOG_DIR/$f.log" ]] && grep -hE '^(torch|ort|trt) |skipped|tokens/s' "$LOG_DIR/$f.log" | tee -a "$LOG_DIR/summary.log" || true
done
if (( ${#FAILED[@]} )); then
    echo "gpu_check: FAILED steps: ${FAILED[*]}" | tee -a "$LOG_DIR/summary.log"
    exit 1
fi
echo "gpu_check: all steps ok" | tee -a "$LOG_DIR/summary.log"
