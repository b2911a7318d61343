#!/bin/sh
# The root deflating a message of 16 KiB or more (bench/root_scale.py), before (9de4a3e, in OLD, with this bench copied
# in as bench/root_scale_ab.py and jobwire.message_of taken for one frame, which that tree sends) and after (NEW),
# alternating, 3 runs each of 400 x 4 and 1000 x 1, then one of 1000 x 4 each. Nothing else on the machine.
set -eu
OLD=${OLD:-/tmp/old2}
NEW=${NEW:-/tmp/new}
OUT=${OUT:-/tmp/deflate}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p "$OUT"
for i in 1 2 3; do
  for size in "400 -L 4" "1000 -L 1"; do
    tag=$(echo "$size" | tr -d ' ,-')
    timeout 900 "$PY" "$OLD/bench/root_scale_ab.py" --nodes $size --iters 20 --idle-s 3 --json "$OUT/deflate_before_${tag}_$i.json"
    timeout 900 "$PY" "$NEW/bench/root_scale.py" --nodes $size --iters 20 --idle-s 3 --json "$OUT/deflate_after_${tag}_$i.json"
  done
done
timeout 900 "$PY" "$OLD/bench/root_scale_ab.py" --nodes 1000 -L 4 --iters 20 --idle-s 3 --json "$OUT/deflate_before_1000L4.json"
timeout 900 "$PY" "$NEW/bench/root_scale.py" --nodes 1000 -L 4 --iters 20 --idle-s 3 --json "$OUT/deflate_after_1000L4.json"
