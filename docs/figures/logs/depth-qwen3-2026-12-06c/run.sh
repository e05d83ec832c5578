#!/bin/bash
# issue 44: bench.scale run with llama.cpp and GenAI's builder as peers, Qwen3-0.6B shape, to depth 8192
cd /work/main && source /work/venv/bin/activate
echo "start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
python -m bench.scale run --shapes qwen3-0.6b --work /work/real \
  --options "int8=--fuse --quantize int4 --max-seq-len 8448 --kv-cache int8;fp32=--fuse --quantize int4 --max-seq-len 8448" \
  --rounds 3 --decode-tokens 32 --threads 2 --depths 0,1024,4096,8192 --prefills 128,1024 \
  --peers genai,llamacpp --gguf /work/real/qwen3-0.6b-gguf/model-q4_0.gguf \
  --llama-bench /work/peers/llama-server-build/bin/llama-bench --reuse-builds --json /work/prof/depth3/depth-qwen3.json
echo "end $(date -u +%T) rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
