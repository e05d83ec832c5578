#!/bin/bash
# issue 43 item 6: the 1B int4 build (ours, verification included) against GenAI's builder, 3 pairs in turn, warm cache
cd /work/main && source /work/venv/bin/activate
F=/work/real/llama-3.2-1b-ours
for r in 1 2 3; do
  rm -rf /work/prof/b50b/ours /work/prof/b50b/genai /work/prof/b50b/gcache
  /usr/bin/time -f "ours round $r wall %e s peak %M KB" python -m export.build --checkpoint $F --fuse --quantize int4 --out /work/prof/b50b/ours > /work/prof/b50b/ours-$r.log 2>&1
  tail -1 /work/prof/b50b/ours-$r.log
  /usr/bin/time -f "genai round $r wall %e s peak %M KB" python -m onnxruntime_genai.models.builder -i $F -o /work/prof/b50b/genai -p int4 -e cpu -c /work/prof/b50b/gcache > /work/prof/b50b/genai-$r.log 2>&1
  tail -1 /work/prof/b50b/genai-$r.log
done
