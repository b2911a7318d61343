#!/bin/sh
# The root at hundreds of nodes (bench/root_scale.py), before (462c57f, in OLD, with this bench copied in as
# bench/root_scale_ab.py, its two decodes without limit=, which that tree lacks) and after (the commit in NEW), alternating, 3 runs
# each; then the sizes only the new root can hold. Run from anywhere with nothing else on the machine.
set -eu
OLD=${OLD:-/tmp/old}
NEW=${NEW:-/work/main}
OUT=${OUT:-/tmp/root_scale}
PY=${PY:-$NEW/.venv/bin/python}
mkdir -p "$OUT"
for i in 1 2 3; do
  for size in "100,250,400 -L 4" "1000 -L 1"; do
    tag=$(echo "$size" | tr -d ' ,-')
    timeout 900 "$PY" "$OLD/bench/root_scale_ab.py" --nodes $size --iters 20 --idle-s 3 --json "$OUT/before_${tag}_$i.json"
    timeout 900 "$PY" "$NEW/bench/root_scale.py" --nodes $size --iters 20 --idle-s 3 --json "$OUT/after_${tag}_$i.json"
  done
done
timeout 1800 "$PY" "$NEW/bench/root_scale.py" --nodes 500,1000 -L 4 --iters 20 --idle-s 3 --json "$OUT/after_L4.json"
timeout 1800 "$PY" "$NEW/bench/root_scale.py" --nodes 2000 -L 1 --iters 10 --idle-s 3 --json "$OUT/after_2000x1.json"
# 462c57f refuses the table of 500 x 4 (exit 1)
timeout 300 "$PY" "$OLD/bench/root_scale_ab.py" --nodes 500 -L 4 --iters 5 --idle-s 1 > "$OUT/before_500x4.log" 2>&1 || true
