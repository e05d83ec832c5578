#!/bin/bash
# issue 44's quality check of the int8 cache: the Qwen3-0.6B shape at 4096 + 256 tokens, and the trained zoo qwen3 at 2048 + 256
set -u
cd /work/main && source /work/venv/bin/activate
OUT=/work/prof/depthq2
echo "start $(date -u +%T)"
python -m bench.scale drift /work/real/build-q06-int4-fp32/model.int4.onnx /work/real/build-q06-int4-int8/model.int4.onnx \
   --prompt-tokens 4096 --new-tokens 256 > $OUT/drift-q06-4096.json 2> $OUT/drift-q06-4096.err
cat $OUT/drift-q06-4096.json
for kv in fp32 int8; do
  python -m export.build --checkpoint models/zoo/qwen3 --fuse --max-seq-len 2304 --kv-cache $kv --out /work/real/zoo-qwen3-$kv > $OUT/zoo-qwen3-$kv.log 2>&1
  grep "^built\|kv_cache int8" $OUT/zoo-qwen3-$kv.log
done
python -m bench.scale drift /work/real/zoo-qwen3-fp32/model.fused.onnx /work/real/zoo-qwen3-int8/model.fused.onnx \
   --prompt-tokens 2048 --new-tokens 256 > $OUT/drift-zoo-qwen3-2048.json 2> $OUT/drift-zoo-qwen3-2048.err
cat $OUT/drift-zoo-qwen3-2048.json
echo "end $(date -u +%T)"
# and, run by hand after it (12:43 UTC): the trained zoo qwen3 at 4096 + 256
# for kv in fp32 int8; do python -m export.build --checkpoint models/zoo/qwen3 --fuse --max-seq-len 4352 --kv-cache $kv --out /work/real/zoo4k-qwen3-$kv; done
# python -m bench.scale drift /work/real/zoo4k-qwen3-fp32/model.fused.onnx /work/real/zoo4k-qwen3-int8/model.fused.onnx --prompt-tokens 4096 --new-tokens 256
