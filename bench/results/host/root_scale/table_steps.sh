#!/bin/sh
# A job-wide step at 400 x 4 and 1000 x 4 after protocol 8 (NEW) and before it (7429ec5, in OLD with this bench copied
# in as bench/root_scale_ab.py), alternating, the new tree first, 3 runs each of 40 steps. Nothing else on the machine.
# Run at 2da58c5 (steps_*) and at the commit after it, which keeps freed memory at the root (TAG=kept_: kept_steps_*).
set -eu
OLD=${OLD:-/tmp/old}
NEW=${NEW:-/tmp/new2}
OUT=${OUT:-/tmp/table}
TAG=${TAG:-}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p "$OUT"
for i in 1 2 3; do
  for size in "400 -L 4" "1000 -L 4"; do
    tag=$(echo "$size" | tr -d ' ,-')
    timeout 900 "$PY" "$NEW/bench/root_scale.py" --nodes $size --iters 40 --idle-s 1 --json "$OUT/${TAG}steps_after_${tag}_$i.json"
    timeout 900 "$PY" "$OLD/bench/root_scale_ab.py" --nodes $size --iters 40 --idle-s 1 --json "$OUT/${TAG}steps_before_${tag}_$i.json"
  done
done
# The root's page faults per step (the bench since records them): at the commit that keeps freed memory (NEW) against
# 2da58c5 (OLD2, this bench copied in), 1000 x 4, alternating, 2 runs each:
#   for i in 1 2; do $PY $NEW/bench/root_scale.py --nodes 1000 -L 4 --iters 40 --idle-s 1 --json $OUT/faults_after_1000L4_$i.json
#     $PY $OLD2/bench/root_scale_ab.py --nodes 1000 -L 4 --iters 40 --idle-s 1 --json $OUT/faults_before_1000L4_$i.json; done
