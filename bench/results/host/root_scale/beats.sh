#!/bin/sh
# Heartbeats left out while other messages flow: ff9c9de (OLD) against 5ce60f2 (NEW), alternating, 3 runs each of
# 1000 x 1 with 40 job-wide steps (bench/root_scale.py, the same in both). Nothing else on the machine.
set -eu
OLD=${OLD:-/tmp/hb_old}
NEW=${NEW:-/tmp/hb_new}
OUT=${OUT:-/tmp/hb}
PY=${PY:-/work/main/.venv/bin/python}
for i in 1 2 3; do
  timeout 600 "$PY" "$OLD/bench/root_scale.py" --nodes 1000 -L 1 --iters 40 --idle-s 2 --json "$OUT/beats_before_1000L1_$i.json"
  timeout 600 "$PY" "$NEW/bench/root_scale.py" --nodes 1000 -L 1 --iters 40 --idle-s 2 --json "$OUT/beats_after_1000L1_$i.json"
done
