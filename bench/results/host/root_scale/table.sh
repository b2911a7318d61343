#!/bin/sh
# A node's table of its own ranks' offers and the job's join info (protocol 8), before (7429ec5, in OLD, with this
# bench copied in as bench/root_scale_ab.py: it drives that tree's every-offer table) and after (NEW), alternating,
# 3 runs each of 400 x 4 and 1000 x 1, then one each of 1000 x 4 and 2000 x 4. Nothing else on the machine.
set -eu
OLD=${OLD:-/tmp/old}
NEW=${NEW:-/tmp/new}
OUT=${OUT:-/tmp/table}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p "$OUT"
for i in 1 2 3; do
  for size in "400 -L 4" "1000 -L 1"; do
    tag=$(echo "$size" | tr -d ' ,-')
    timeout 900 "$PY" "$OLD/bench/root_scale_ab.py" --nodes $size --iters 20 --idle-s 3 --json "$OUT/table_before_${tag}_$i.json"
    timeout 900 "$PY" "$NEW/bench/root_scale.py" --nodes $size --iters 20 --idle-s 3 --json "$OUT/table_after_${tag}_$i.json"
  done
done
for size in "1000 -L 4" "2000 -L 4"; do
  tag=$(echo "$size" | tr -d ' ,-')
  timeout 900 "$PY" "$OLD/bench/root_scale_ab.py" --nodes $size --iters 10 --idle-s 3 --json "$OUT/table_before_${tag}.json"
  timeout 900 "$PY" "$NEW/bench/root_scale.py" --nodes $size --iters 10 --idle-s 3 --json "$OUT/table_after_${tag}.json"
done
