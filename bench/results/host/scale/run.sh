#!/bin/bash
# host A/B: step latency (c8de1ff vs HEAD) and multi-node (938b4c2 vs HEAD), alternating
set -u
export TRAY_JOBS_ROOT=$(mktemp -d /tmp/meas-jobs.XXXX); chmod 700 $TRAY_JOBS_ROOT
PY=/work/main/.venv/bin/python
O=/tmp/meas/out; mkdir -p $O/step_latency $O/scale
cd /tmp
for i in 1 2 3; do
  PYTHONPATH=/tmp/old-c8 timeout 300 $PY /work/main/bench/step_latency.py --ranks 2,4,8 --steps 3000 --json $O/step_latency/before_$i.json | tail -4
  PYTHONPATH=/work/main timeout 300 $PY /work/main/bench/step_latency.py --ranks 2,4,8 --steps 3000 --json $O/step_latency/after_$i.json | tail -4
done
for i in 1 2 3; do
  timeout 300 $PY /tmp/old-938/bench/startup_nodes_ab.py --nnodes 8 -n 2 --repeats 1 --iters 200 --json $O/scale/ab_before_$i.json | tail -2
  timeout 300 $PY /work/main/bench/startup_nodes.py --nnodes 8 -n 2 --repeats 1 --iters 200 --json $O/scale/ab_after_$i.json | tail -2
done
timeout 600 $PY /work/main/bench/startup_nodes.py --nnodes 1,2,4,8,16 -n 2 --repeats 3 --json $O/scale/after_n2.json | tail -6
timeout 600 $PY /work/main/bench/startup_nodes.py --nnodes 18 -n 4 --repeats 3 --json $O/scale/after_18x4.json | tail -2
timeout 900 $PY /work/main/bench/startup_nodes.py --nnodes 32,64 -n 1 --repeats 3 --json $O/scale/after_n1.json | tail -3
rm -rf $TRAY_JOBS_ROOT
echo DONE
