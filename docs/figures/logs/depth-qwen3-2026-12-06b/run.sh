#!/bin/bash
# issue 44 after with_fp32_first_prompt: Qwen3-0.6B shape int4, int8 KV cache (ours) vs llama.cpp Q4_0, interleaved
set -u
cd /work/main && source /work/venv/bin/activate
OUT=/work/prof/depthq2
LB=/work/peers/llama-server-build/bin/llama-bench
G=/work/real/qwen3-0.6b-gguf/model-q4_0.gguf
for r in 1 2 3; do
  echo "round $r $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python -m bench.scale decode /work/real/build-q06-int4-int8/model.int4.onnx --threads 2 --decode-tokens 32 \
    --depths 0,1024,4096,8192 --prefills 128,1024 > $OUT/ours-int8-r$r.json 2> $OUT/ours-int8-r$r.err
  echo "  ours int8: $(head -c 700 $OUT/ours-int8-r$r.json) $(date -u +%T)"
  $LB -m $G -t 2 -p 0 -n 32 -d 0,1024,4096,8192 -fa on,off -r 1 -o jsonl > $OUT/llama-decode-r$r.jsonl 2> $OUT/llama-decode-r$r.err
  $LB -m $G -t 2 -p 128,1024 -n 0 -fa on,off -r 1 -o jsonl > $OUT/llama-prefill-r$r.jsonl 2> $OUT/llama-prefill-r$r.err
  echo "  llama.cpp done $(date -u +%T)"
done
echo "end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
