#!/bin/bash
# triplets.sh NEW BASE WORK [N]: ours at NEW, ours at BASE, GenAI's builder, N rounds in turn, warm cache
NEW=$1; BASE=$2; W=$3; N=${4:-3}
source /work/venv/bin/activate
F=/work/real/llama-3.2-1b-ours
mkdir -p $W
for r in $(seq 1 $N); do
  for side in new base; do
    rm -rf $W/ours
    if [ $side = new ]; then cd $NEW; else cd $BASE; fi
    /usr/bin/time -f "$side round $r wall %e s peak %M KB user %U sys %S" python -m export.build --checkpoint $F --fuse --quantize int4 --out $W/ours > $W/$side-$r.log 2>&1
    tail -1 $W/$side-$r.log
  done
  rm -rf $W/genai $W/gcache
  /usr/bin/time -f "genai round $r wall %e s peak %M KB user %U sys %S" python -m onnxruntime_genai.models.builder -i $F -o $W/genai -p int4 -e cpu -c $W/gcache > $W/genai-$r.log 2>&1
  tail -1 $W/genai-$r.log
done
