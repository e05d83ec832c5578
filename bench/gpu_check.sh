#!/usr/bin/env bash
# bench/gpu_check.sh: everything that needs a GPU, in one short run (< 8 minutes), logs in one archive.
#
#   bash bench/gpu_check.sh                                   # archive: $OUT/gpu_check.tar.gz ($OUT unset: gpu_check_out/)
#   GPU_CHECK_SKIP_INSTALL=1 PYTHON=python3 bash bench/gpu_check.sh      # use what the machine has, no pip at all
#   GPU_CHECK_PARTS="probe torch_decode" bash bench/gpu_check.sh         # some parts only
#
# Made for the borrowed GPU machine: CUDA PyTorch preinstalled as python3, no network, a small
# file-return limit. The project runs from this source tree (PYTHONPATH), never pip-installed: that
# would replace the machine's CUDA torch by the pinned CPU wheel of pyproject.toml.
#
# Parts, cheapest and most telling first. Each reports one line in summary.txt:
#   ok (N s) | skipped: <why> | FAILED rc=N (N s)
# A part whose requirement is missing (no CUDA device, no tensorrt, no time left) is skipped with
# its reason, never failed; the script exits 0 unless a part that ran failed.
#   machine       date, machine, nvidia-smi, python, versions of the packages that matter
#   install       wheels from $GPU_CHECK_WHEELS or ./wheels or ./.whl (no index, no deps, into a private folder on
#                 PYTHONPATH), else with GPU_CHECK_ONLINE=1 each extra in its own pip call (a failing
#                 one, e.g. tensorrt without NVIDIA's index, cannot take the others down), torch pinned
#                 to the installed version; skipped otherwise. GPU_CHECK_DRY_RUN=1 prints the commands.
#   probe         torch / CUDA device, ONNX Runtime providers, tensorrt, onnx-graphsurgeon
#   torch_decode  the paper's headline: python -m bench.gpu_decode (torch backend, CUDA graphs,
#                 rmsnorm-strong vs internal-/all-taper-fused, sizes 1M..124M, batch 1 and 8, fp32 and bf16)
#   families_decode  issue 34's pair on the GPU: python -m bench.gpu_decode --shapes qwen3-0.6b,gemma-3-1b
#                 (random-init at the real shapes: rmsnorm-strong vs all-taper-fused, bf16, batch 1, CUDA graphs)
#   pytest_gpu    pytest -m gpu tests/runtime (torch CUDA graphs, ORT CUDA provider, its row steps) and the
#                 Triton generate model on ort-cuda (tests/triton/test_generate_backend.py), TensorRT tests apart
#   trt_tests     pytest -m gpu tests/runtime/test_trt_session.py (parse, KV-cache layers, both profiles,
#                 aliasing, prefill + decode vs ORT CPU with TF32 off and on, the portable graph's If over the
#                 live slots at 1024 slots), then TensorRT's row steps and
#                 the Triton generate model on the repository's engine (trt), where tensorrt imports
#   trt_bench     decode step timing of fused builds on the trt backend, where tensorrt imports
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$REPO/gpu_check_out}"
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-460} ))   # all parts; the archive is written after
PARTS="${GPU_CHECK_PARTS:-machine install probe torch_decode families_decode pytest_gpu trt_tests trt_bench}"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
LOG_DIR="$WORK/gpu_check"                      # what the archive holds (logs only: builds stay in $WORK)
mkdir -p "$LOG_DIR" "$OUT_DIR"
FAILED=0
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=15
export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export REPO WORK LOG_DIR PY

say() { echo "$*" | tee -a "$LOG_DIR/summary.txt"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
skip() { echo "SKIPPED: $*"; exit 0; }       # inside a part: report the reason, end the part

# part NAME LIMIT_S: run the function NAME under timeout min(LIMIT_S, time left); log to NAME.log
part() {
    local name=$1 limit=$2 budget t0 rc
    [[ " $PARTS " == *" $name "* ]] || return 0
    budget=$(left)
    (( budget < limit )) && limit=$budget
    if (( limit < 15 )); then
        say "$(printf '%-13s' "$name") skipped: no time left ($(left) s of the budget)"; return 0
    fi
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$name" >"$LOG_DIR/$name.log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - t0 )) why
    why=$(grep -m1 '^SKIPPED: ' "$LOG_DIR/$name.log" | cut -c10-)
    if (( rc == 0 )) && [[ -n "$why" ]]; then
        say "$(printf '%-13s' "$name") skipped: $why"
    elif (( rc == 0 )); then
        say "$(printf '%-13s' "$name") ok (${took} s)"
    else
        (( rc == 124 || rc == 137 )) && why=" (timed out at $limit s)" || why=""
        say "$(printf '%-13s' "$name") FAILED rc=$rc$why (${took} s); see $name.log"
        FAILED=1
    fi
}

has() { "$PY" -c "import $1" >/dev/null 2>&1; }
# why CUDA cannot be used with $PY, or nothing; asked once per run (torch's import is the slow part)
CUDA_PY='
try:
    import torch
except ImportError:
    print("torch is not importable")
else:
    if not torch.cuda.is_available():
        print("torch sees no CUDA device (torch.cuda.is_available() is False)")
'
export CUDA_PY
cuda_problem() {
    if [[ ! -f "$WORK/cuda_problem" ]]; then
        "$PY" -c "$CUDA_PY" > "$WORK/cuda_problem" 2>/dev/null || echo "torch could not be asked ($PY failed)" > "$WORK/cuda_problem"
    fi
    cat "$WORK/cuda_problem"
}
need_cuda() { local why; why=$(cuda_problem); [[ -z "$why" ]] || skip "$why (python: $PY)"; }
need_trt() { need_cuda; has tensorrt || skip "tensorrt is not importable (pip install tensorrt --extra-index-url https://pypi.nvidia.com)"; }
has_ort_cuda() { "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; }

machine() {
    date -u; uname -a
    command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not on PATH"
    echo "python: $PY ($("$PY" --version 2>&1))"; cat /proc/loadavg
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|onnx|onnxruntime|onnxscript|tensorrt|numpy|pytest|transformers|tokenizers|safetensors)[- ]' || true
}

# Requirements of one extra of pyproject.toml, one per line (tomllib: Python >= 3.11).
extra_reqs() { "$PY" - "$1" <<'EOF'
import sys, tomllib
extra = sys.argv[1]
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] if extra == "base" else project["optional-dependencies"][extra]
print("\n".join(r for r in reqs if not r.lower().startswith("torch")))   # never touch the machine's torch
EOF
}

install() {
    [[ -n "${GPU_CHECK_SKIP_INSTALL:-}" ]] && skip "GPU_CHECK_SKIP_INSTALL is set: using what $PY has"
    local run=() wheels=""
    [[ -n "${GPU_CHECK_DRY_RUN:-}" ]] && run=(echo "would run:")
    for d in ${GPU_CHECK_WHEELS:-wheels .whl}; do [[ -d "$d" ]] && compgen -G "$d/*.whl" >/dev/null && wheels=$d && break; done
    if [[ -n "$wheels" ]]; then
        echo "offline: the wheels in $wheels, without deps, into $WORK/site (on PYTHONPATH)"
        "${run[@]}" "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$wheels"/*.whl
        return
    fi
    [[ -z "${GPU_CHECK_ONLINE:-}" ]] && skip "no wheels (GPU_CHECK_WHEELS, ./wheels, ./.whl) and GPU_CHECK_ONLINE is not set (the lent GPU machine has no network)"
    # torch stays what the machine has: the pinned CPU wheel of pyproject.toml must not replace it
    local pins="$WORK/constraints.txt" extra reqs ok=0 bad=()
    "$PY" -c "import torch; print('torch==' + torch.__version__)" > "$pins" 2>/dev/null || : > "$pins"
    for extra in base dev gpu tensorrt; do
        mapfile -t reqs < <(extra_reqs "$extra")
        local index=()
        [[ "$extra" == tensorrt ]] && index=(--extra-index-url "${TRT_INDEX_URL:-https://pypi.nvidia.com}")
        echo "== extra $extra: ${reqs[*]}"
        if "${run[@]}" "$PY" -m pip install -q -c "$pins" "${index[@]}" "${reqs[@]}"; then ok=$((ok + 1)); else bad+=("$extra"); fi
    done
    # onnxruntime and onnxruntime-gpu install the same package: keep only the GPU build where it is there
    if [[ -z "${run[*]}" ]] && "$PY" -m pip show onnxruntime-gpu >/dev/null 2>&1 && ! has_ort_cuda; then
        "$PY" -m pip uninstall -y onnxruntime onnxruntime-gpu && "$PY" -m pip install -q --no-deps onnxruntime-gpu
    fi
    echo "extras installed: $ok; failed: ${bad[*]:-none} (tests skip what is missing)"
}

probe() {
    "$PY" - <<'EOF'
import importlib
def version(name):
    try:
        m = importlib.import_module(name)
        return getattr(m, "__version__", "?")
    except Exception as e:
        return f"not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
for name in ("torch", "onnx", "onnxruntime", "onnxscript", "tensorrt", "onnx_graphsurgeon", "numpy"):
    print(f"{name:18s} {version(name)}")
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("device", p.name, f"sm{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
        print("tf32 matmul allowed (torch):", torch.backends.cuda.matmul.allow_tf32)
except Exception as e:
    print("torch probe failed:", e)
try:
    import onnxruntime
    print("onnxruntime providers", onnxruntime.get_available_providers())
except Exception as e:
    print("onnxruntime probe failed:", e)
EOF
}

torch_decode() {
    need_cuda
    "$PY" -m bench.gpu_decode --sizes "${GPU_CHECK_SIZES:-1M,8M,30M,124M}" --dtypes fp32,bf16 --batches 1,8 \
        --steps 128 --warmup 16 --rounds 5 --json "$LOG_DIR/torch_decode.json"
}

families_decode() {
    need_cuda
    "$PY" -m bench.gpu_decode --shapes "${GPU_CHECK_SHAPES:-qwen3-0.6b,gemma-3-1b}" --dtypes bf16 --batches 1 \
        --steps 128 --warmup 16 --rounds 5 --json "$LOG_DIR/families_decode.json"
}

pytest_gpu() {
    need_cuda
    "$PY" -m pytest -m gpu tests/runtime tests/triton/test_generate_backend.py --ignore=tests/runtime/test_trt_session.py \
        --deselect "tests/runtime/test_scheduler.py::test_gpu_row_steps_touch_only_their_rows[trt]" \
        --deselect "tests/triton/test_generate_backend.py::test_generate_on_the_gpu_batches_with_the_cpus_tokens[trt]" \
        -rs -v -p no:cacheprovider --junitxml="$LOG_DIR/pytest_gpu.xml"
}

trt_tests() {
    need_trt
    "$PY" -m pytest -m gpu tests/runtime/test_trt_session.py -rs -v -p no:cacheprovider \
        --junitxml="$LOG_DIR/trt_tests.xml" || return 1
    # the batch scheduler on TensorRT: row steps, and generate's session over the repository's engine
    "$PY" -m pytest -m gpu "tests/runtime/test_scheduler.py::test_gpu_row_steps_touch_only_their_rows[trt]" \
        "tests/triton/test_generate_backend.py::test_generate_on_the_gpu_batches_with_the_cpus_tokens[trt]" \
        -rs -v -p no:cacheprovider --junitxml="$LOG_DIR/trt_generate.xml"
}

trt_bench() {
    need_trt
    has onnx_graphsurgeon || skip "onnx-graphsurgeon is not importable (export.build --fuse needs it; carry its wheel in ./wheels)"
    local build="$WORK/builds" zoo=models/zoo
    for kind in baseline all-taper qwen3 qwen3-all-taper; do
        [[ -d "$zoo/$kind" ]] || continue
        "$PY" -m export.build --fuse --target portable --checkpoint "$zoo/$kind" --out "$build/$kind" || return 1
    done
    "$PY" -m runtime.step_timing --backend trt --model "$build/baseline" --model "$build/all-taper" \
        --batch 1 --prompt-len 16 --steps 200 --rounds 3 || return 1
    # issue 34's pair on TensorRT, at the zoo's size: the RMSNorm Qwen3 (QK-norms) vs its all-taper fine-tune
    if [[ -d "$build/qwen3" && -d "$build/qwen3-all-taper" ]]; then
        "$PY" -m runtime.step_timing --backend trt --model "$build/qwen3" --model "$build/qwen3-all-taper" \
            --batch 1 --prompt-len 16 --steps 200 --rounds 3
    fi
}

export -f say skip has cuda_problem need_cuda need_trt has_ort_cuda extra_reqs machine install probe torch_decode families_decode pytest_gpu trt_tests trt_bench

say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n): python $PY, parts: $PARTS"
part machine 30
part install 150
part probe 60
part torch_decode 200
part families_decode 120
part pytest_gpu 120
part trt_tests 200
part trt_bench 120

for f in "$LOG_DIR"/torch_decode.log "$LOG_DIR"/trt_bench.log; do
    [[ -f "$f" ]] && grep -hE '^(torch-cuda|trt) ' "$f" | tee -a "$LOG_DIR/summary.txt"
done
(( FAILED )) && say "gpu_check: a part FAILED (see above)" || say "gpu_check: no part failed"
cp "$LOG_DIR/summary.txt" "$OUT_DIR/gpu_check_summary.txt"
tar -czf "$OUT_DIR/gpu_check.tar.gz" -C "$WORK" gpu_check && echo "archive: $OUT_DIR/gpu_check.tar.gz ($(du -h "$OUT_DIR/gpu_check.tar.gz" | cut -f1))"
rm -rf "$WORK"
exit "$FAILED"
