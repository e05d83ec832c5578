#!/bin/bash
# issue 44: the default build (auto KV cache) of the Llama-3.2-1B shape at 8448 slots vs llama.cpp Q4_0, to depth 8192
cd /work/main && source /work/venv/bin/activate
echo "start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
python -m bench.scale run --shapes llama-3.2-1b --work /work/real \
  --options "default=--fuse --quantize int4 --max-seq-len 8448" \
  --rounds 3 --decode-tokens 32 --threads 2 --depths 0,1024,4096,8192 --prefills 128,1024 \
  --peers llamacpp --gguf /work/real/llama-3.2-1b-gguf/model-q4_0.gguf \
  --llama-bench /work/peers/llama-server-build/bin/llama-bench --reuse-builds --json /work/prof/depth1b3/depth-1b.json
echo "end $(date -u +%T) rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
