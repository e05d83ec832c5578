#!/bin/bash
# rebuild every zoo model x option at HEAD; compare the graph and its weights byte for byte with the
# builds of d4b1c59 (the merge) in /work/cmp/builds/main-*
cd /work/main; . /work/venv/bin/activate
for m in $(ls models/zoo); do
  [ -f models/zoo/$m/config.json ] || continue
  for opt in fuse fuse-portable int4; do
    case $opt in fuse) a="--fuse";; fuse-portable) a="--fuse --target portable";; int4) a="--fuse --quantize int4";; esac
    out=/work/cmp/head/$m-$opt; ref=/work/cmp/builds/main-$m-$opt
    rm -rf $out
    if ! python -m export.build --checkpoint models/zoo/$m --out $out $a > /dev/null 2> /tmp/bytecmp.err; then
      echo "$m $opt: build failed: $(tail -1 /tmp/bytecmp.err)"; continue; fi
    [ -d $ref ] || { echo "$m $opt: no earlier build"; continue; }
    same=yes
    for f in $(cd $ref && ls *.onnx *.data 2>/dev/null); do
      cmp -s $ref/$f $out/$f || same="no ($f)"
    done
    echo "$m $opt: byte-identical graph files: $same ($(cd $ref && ls *.onnx *.data 2>/dev/null | tr '\n' ' '))"
  done
done
