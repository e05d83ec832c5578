#!/bin/bash
# issue 44 on this machine: Llama-3.2-1B shape int4 with the int8 KV cache (ours) vs llama.cpp Q4_0, depth to 8192
set -u
cd /work/main && source /work/venv/bin/activate
OUT=/work/prof/depth1b
B=/work/real/build-1b-int4-d8k      # model.int8cache.onnx: rewrite_int8.py (the build's int8 check failed: build-int8.log)
LB=/work/peers/llama-server-build/bin/llama-bench
G=/work/real/llama-3.2-1b-gguf/model-q4_0.gguf
for r in 1; do
  echo "round $r $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python -m bench.scale decode $B/model.int8cache.onnx --threads 2 --decode-tokens 32 \
      --depths 0,1024,4096,8192 --prefills 1024 > $OUT/ours-int8-r$r.json 2> $OUT/ours-int8-r$r.err
  echo "  ours int8: $(head -c 700 $OUT/ours-int8-r$r.json) $(date -u +%T)"
  $LB -m $G -t 2 -p 0 -n 32 -d 0,1024,4096,8192 -fa on,off -r 1 -o jsonl > $OUT/llama-decode-r$r.jsonl 2> $OUT/llama-decode-r$r.err
  $LB -m $G -t 2 -p 1024 -n 0 -fa on,off -r 1 -o jsonl > $OUT/llama-prefill-r$r.jsonl 2> $OUT/llama-prefill-r$r.err
  echo "  llama.cpp done $(date -u +%T)"
done
echo "end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
