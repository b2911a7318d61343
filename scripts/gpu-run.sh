#!/usr/bin/env bash
# The GPU pass, one call on the GPU machine: install the carried wheels, then run the named stages.
# Each stage has its own timeout and writes under $OUT (default ./gpu-out).
#
#   scripts/gpu-run.sh tests gate bench-barrier bench-startup doctor
#
# Stages: env doctor unit tests gate drop variants ep-moe tp park bench-barrier bench-startup
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
LOGS="${LOGS:-$OUT}"  # NOTE: only 8 files come back from the device machine: logs may go elsewhere
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRAY_CACHE_DIR="${TRAY_CACHE_DIR:-/tmp/tray-cache}"
scripts/gpu-wheels.sh install >/dev/null || { echo "wheel install failed"; exit 1; }
eval "$(scripts/gpu-wheels.sh env)"
N="${N:-4}"
PY=python3

stage() {  # stage NAME TIMEOUT_S CMD...
    local name=$1 t=$2; shift 2
    echo "=== $name ($(date +%T))"
    local t0=$SECONDS
    timeout -k 10 "$t" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"
}

for s in "$@"; do
    case "$s" in
        env) stage env 60 bash -c 'nvidia-smi -L; nvidia-smi topo -m; python3 -c "import sys, torch, cuda.bindings, nccl.bindings.nccl as n; print(sys.version, torch.__version__, cuda.bindings.__version__, n.get_version())"' ;;
        doctor) stage doctor 120 $PY -m tray doctor --json; cp "$LOGS/doctor.log" "$OUT/doctor.json" ;;
        unit) stage unit 300 $PY -m pytest -q -x tests/gpu/test_cuda_backend.py ;;
        tests) stage tests 300 $PY -m pytest -q -m gpu tests/gpu ;;
        gate) stage gate 120 $PY -m tray gate peer-barrier -n "$N" --backend cuda --json "$OUT/gate.json" ;;
        drop) stage drop 60 $PY -m tray gate peer-barrier -n "$N" --backend cuda --drop $((N - 1)) --json "$OUT/gate_drop.json" ;;
        variants) stage variants 200 $PY bench/barrier_variants.py -n "$N" --json "$OUT/barrier_variants.json" ;;
        ep-moe) stage ep_moe 300 $PY -m tray bench ep-moe -n "$N" --backend cuda --json "$OUT/ep_moe.json" --plot "$OUT/ep_moe.png" ;;
        tp) stage tp 150 $PY -m tray bench tp -n "$N" --backend cuda --json "$OUT/tp.json" ;;
        park) stage park 200 $PY -m tray bench park -n "$N" --backend cuda --repeats 3 --json "$OUT/park.json" ;;
        bench-barrier) stage bench_barrier 300 $PY bench/peer_barrier.py -n "$N" --backend cuda --json "$OUT/peer_barrier.json" ;;
        bench-startup) stage bench_startup 300 $PY bench/startup.py -n "$N" --backend cuda --repeats 3 --json "$OUT/startup.json" ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
