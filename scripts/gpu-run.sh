#!/usr/bin/env bash
# The GPU pass, one call on the GPU machine: install the carried wheels, then run the named stages.
# Each stage has its own timeout and writes its JSON under $OUT (default ./gpu-out), its log under $LOGS.
#
#   scripts/gpu-run.sh tests gate bench-barrier bench-startup doctor
#   scripts/gpu-run.sh perf      # gate stress variants tp bench-barrier bench-startup park: 7 JSON files
#
# A 4-GPU pass (nvidia-h200-x4; results to bench/results/h200x4/ and h200x4-2nodes/), in calls of at most ~9 min:
# (every step's paths already passed their checks at 4 ranks sharing one H200: the shared-* stages, h200-shared/)
#   1. N=4 TESTS_K=early scripts/gpu-run.sh tests       the early NCCL join at 4 ranks (~15 s); should it fail,
#                                                       export TRAY_JOIN_COLLECTIVES=lazy for every later stage
#   2. N=4 scripts/gpu-run.sh ep-moe bench-barrier      EP4 and the barrier beside torch's SymmetricMemory
#   3. N=4 scripts/gpu-run.sh tp bench-startup          the TP sweep with NCCL's window kernels; launch -> 4 ready
#   4. EP_NODES_N=4 scripts/gpu-run.sh ep-nodes2; TP_NODES_N=4 scripts/gpu-run.sh tp-nodes2; N=4 ... nodes2
#   5. N=4 scripts/gpu-run.sh tests torch               every GPU test at 4 ranks
#
# Stages: env doctor unit tests gate drop stress variants ep-moe ep-moe-quick ep-moe-cublas ep-moe-wgmma ep-moe-nccl24
# ep-moe-worst ep-ll-phases
# ep-moe-fp8 ep-moe-fp8-tests ep-tests expert-gemm wgmma swiglu gemm-ncu
# ep-moe-nccl-graph ep-moe-nccl-graph-noreg experts-ep-tp tp tp-tests tp-ll tune park
# shared-gate shared-stress shared-drop shared-ep shared-tp shared-tests shared-nodes2 shared-ep-nodes2 shared-tp-nodes2
# shared-torch (N ranks sharing the visible GPUs, TRAY_SHARE_GPUS=1: the multi-rank paths checked for correctness on
# fewer GPUs than ranks; $OUT/shared_*.json; their timings mean nothing)
# bench-barrier bench-startup teardown import-cost nccl-lifecycle launch-cost torch examples nodes2 ep-nodes2 tp-nodes2 perf
# `nccl-lifecycle` (one GPU, ~60 s): 1-rank NCCL communicators joined and closed three ways, with NCCL_RUNTIME_CONNECT
# 0 and 1, and NCCL's own INFO account of a join ($OUT/nccl_lifecycle.json).
# `import-cost` (one GPU, ~30 s): a rank's imports in fresh interpreters, with and without the driver warm-up
# thread running, and their -X importtime profile (bench/import_cost.py; $OUT/import_cost.json).
# `launch-cost` times one launch from Python per launch path on GPU 0 (bench/launch_cost.py; $OUT/launch_cost.json),
# with torch's small-kernel launch beside it when this Python imports torch.
# `expert-gemm` (one GPU, ~3 min): the experts' masked GEMMs at the EP2 rank's shapes, every tile shape of
# bench/expert_gemm.py beside cuBLAS per expert and the GPU's read rate over the same weights ($OUT/expert_gemm.json).
# EP_ARGS: extra arguments to the ep-moe and ep-moe-cublas stages (e.g. "--nccl-timing captured").
# TP_ARGS: extra arguments to the tp stage (e.g. "--no-nccl-windows", if NCCL refuses the window registration).
# TRAY_JOIN_COLLECTIVES (auto, early, lazy) reaches every tray the stages start, the benches' among them.
# TORCH_K: a pytest -k expression for the torch stage ($OUT/torch.json keeps what each test printed).
# TESTS_K: a pytest -k expression for the tests stage (all GPU tests without it); STARTUP_ARGS: the startup
# bench's arguments after -n and --backend (default "--repeats 3").
# `nodes2` runs two `tray launch --nnodes 2` over half the GPUs each (scripts/gpu-nodes2.sh; $OUT/nodes2.json:
# the spanning barrier hierarchical, eager / eager-sync / captured, next to the relayed barrier of the same run).
# `ep-nodes2` runs `tray bench ep-moe -n 2 --nnodes 2` on GPUs 0 and 1 as two one-GPU nodes (each its own
# NCCL_HOSTID): the peer path (each node's rows through its peer tables, the other node's staged and carried
# by an NCCL all-to-all across nodes) and the NCCL path, both checked against EP1 byte for byte
# ($OUT/ep_moe_nodes2.json with the environment); the NCCL node counts rank 0 logged are printed after it.
# EP_NODES_N=4 (4 GPUs): two nodes of two, so the peer path also writes within each node through its mappings.
# `tp-nodes2` runs `tray bench tp -n 4 --nnodes 2` (4 GPUs; TP_NODES_N to change) as two nodes of two GPUs, each
# its own NCCL_HOSTID: TP within each node (peer mappings, barriers and the NCCL baseline never leave it), every
# path checked after its timed replays on every rank ($OUT/tp_nodes2.json); the NCCL communicators rank 0 logged
# are printed after it: the baseline's (group node) nRanks 2 nNodes 1; the world group's and its node leaders',
# joined with every group though TP never uses them, span the 2 nodes.
# `tune` (~2 min at 2 ranks, bounded at 190 s; one log and two JSON files): the barrier variants aimed at the captured
# figure, timed and stressed ($OUT/tune_variants.json), then the low-latency allreduce at 15 launch shapes (threads
# per block x lines per thread) over 8 B .. 256 KiB, each checked after its timed replays ($OUT/tune_tp.json).
# `tp-ll` (~3-4 min at 2 ranks, bounded at 470 s): the two line formats of the low-latency allreduce in one run
# (ar_ll: 2 bf16 and a 32-bit flag per 8-byte word; ar_ll3: 3 bf16 and a 16-bit flag; ar_ll3 also at 128 and 512
# threads per block) beside the one-shot, two-shot and NCCL at every power of two 8 B .. 1 MiB, each checked after
# its timed replays ($OUT/tp_ll.json); then the GPU tests of both formats at 2 ranks (4 where visible): the
# bench at 4 sizes, the graph-replayed stress, the bounded wait naming a rank that never sends.
# `torch` runs tests/gpu/test_torch.py against the INSTALLED tray wheel (python -P: the checkout is not on
# sys.path) with the Python that has torch ($TORCH_PY, default python3, else /opt/torch/.venv/bin/python),
# and writes $OUT/torch.json (per test: outcome, seconds, the tail of a failure; the environment). Bounded:
# 60 s per test (each rank program exits with every thread's stack after 20 s), pytest 200 s, the stage 240 s.
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
if [ -z "${TORCH_PY:-}" ]; then
    TORCH_PY=python3
    if ! python3 -c "import torch" 2>/dev/null && [ -x /opt/torch/.venv/bin/python ]; then
        TORCH_PY=/opt/torch/.venv/bin/python
    fi
fi

torch_stage() {  # the installed wheel inside torch programs; JSON from pytest's junit XML
    local junit="$LOGS/torch.xml"
    rm -f "$junit"
    NCCL_DEBUG=WARN timeout -k 5 200 $TORCH_PY -P -m pytest -q -m gpu tests/gpu/test_torch.py -p no:cacheprovider \
        --timeout 60 --junitxml "$junit" -o junit_logging=system-out ${TORCH_K:+-k "$TORCH_K"}
    local rc=$?
    $TORCH_PY -P - "$junit" "$OUT/torch.json" <<'PYEOF'
import json, os, platform, subprocess, sys, xml.etree.ElementTree as ET
import torch, tray
tests = []
try:
    cases = list(ET.parse(sys.argv[1]).iter("testcase"))
except (OSError, ET.ParseError) as exc:  # pytest itself was killed: say so instead of no file
    cases = []
    tests.append({"test": "(pytest)", "outcome": "error", "seconds": 0.0, "detail": f"no junit XML: {exc}",
                  "tail": []})
for case in cases:
    outcome, detail, tail = "passed", "", []
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            detail = (node.get("message") or "")[:2000]
            tail = (node.text or "").splitlines()[-80:]  # the ranks' stderr tail (faulthandler stacks)
            break
    out = case.find("system-out")  # what the test printed (-o junit_logging=system-out)
    tests.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                  "detail": detail, "tail": tail,
                  "stdout": [] if out is None else (out.text or "").strip().splitlines()[-20:]})
    print(f"{outcome:8} {float(case.get('time', 0)):6.1f} s  {case.get('name')}")
try:
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()
except OSError:
    gpus = []
json.dump({"stage": "torch", "tests": tests, "passed": sum(t["outcome"] == "passed" for t in tests),
           "env": {"python": platform.python_version(), "torch": torch.__version__, "tray": tray.__file__,
                   "gpus": gpus, "commit": os.environ.get("TRAY_COMMIT", "")}}, open(sys.argv[2], "w"), indent=2)
print(f"wrote {sys.argv[2]}: {sum(t['outcome'] == 'passed' for t in tests)}/{len(tests)} passed")
PYEOF
    return $rc
}
export -f torch_stage
export TORCH_PY LOGS OUT

tune_stage() {  # the barrier variants aimed at the captured figure, then the low-latency allreduce's launch shapes
    timeout -k 5 85 $PY bench/barrier_variants.py -n "$N" --json "$OUT/tune_variants.json" \
        --only production,prev_production,v9_parallel_acqpoll,v10_shfl,v11_strelease,v13_late_dependents
    local v=$?
    timeout -k 5 95 $PY -m tray bench tp -n "$N" --backend cuda --sizes 8,64,512,2048,8192,16384,32768,65536,131072,262144 \
        --tokens 1 --repeats 10 --ll-sweep-bytes 262144 --ll-shapes 'threads=32,64,128,256,512;lines=1,2,4' \
        --json "$OUT/tune_tp.json"
    local t=$?
    echo "tune: barrier variants rc=$v, tp rc=$t"
    [ "$v" -eq 0 ] && [ "$t" -eq 0 ]
}
export -f tune_stage
export PY N

stage() {  # stage NAME TIMEOUT_S CMD...
    local name=$1 t=$2; shift 2
    echo "=== $name ($(date +%T))"
    local t0=$SECONDS
    timeout -k 10 "$t" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"
}

stage_live() {  # stage_live NAME TIMEOUT_S CMD...: as stage, and the bench's progress lines (its own and rank 0's,
    # each with elapsed seconds) show as they come, so a stage stopped from outside still says where it was
    local name=$1 t=$2; shift 2
    echo "=== $name ($(date +%T))"
    local t0=$SECONDS
    timeout -k 10 "$t" "$@" 2>&1 | tee "$LOGS/$name.log" | grep --line-buffered -E '^((ep-moe|tp): |\[rank 0\] [^ ])'
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        tail -n 25 "$LOGS/$name.log"
    else
        [ "$rc" -eq 124 ] && echo "=== $name TIMED OUT after $t s; the log's tail:"
        tail -n 60 "$LOGS/$name.log"
    fi
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"
}

STAGES=()
for s in "$@"; do
    if [ "$s" = perf ]; then STAGES+=(gate stress variants tp bench-barrier bench-startup park); else STAGES+=("$s"); fi
done

for s in "${STAGES[@]}"; do
    case "$s" in
        env) stage env 60 bash -c 'nvidia-smi -L; nvidia-smi topo -m; python3 -c "import sys, torch, cuda.bindings, nccl.bindings.nccl as n; print(sys.version, torch.__version__, cuda.bindings.__version__, n.get_version())"' ;;
        doctor) stage doctor 120 $PY -m tray doctor --json; cp "$LOGS/doctor.log" "$OUT/doctor.json" ;;
        unit) stage unit 300 $PY -m pytest -q -x tests/gpu/test_cuda_backend.py ;;
        tests) stage tests 300 $PY -m pytest -q -m gpu tests/gpu ${TESTS_K:+-k "$TESTS_K"} ;;
        # N ranks sharing the visible GPUs (TRAY_SHARE_GPUS=1: rank r on GPU r mod G, time-sliced, NCCL over sockets):
        # the multi-rank paths checked for correctness on fewer GPUs than ranks; their timings mean nothing
        shared-gate) stage shared_gate 120 env TRAY_SHARE_GPUS=1 $PY -m tray gate peer-barrier -n "$N" --backend cuda --iters 50 --json "$OUT/shared_gate.json" ;;
        shared-stress) stage shared_stress 150 env TRAY_SHARE_GPUS=1 $PY -m tray gate peer-barrier -n "$N" --backend cuda --stress --iters 100 --replays 3 --json "$OUT/shared_gate_stress.json" ;;
        shared-drop) stage shared_drop 90 env TRAY_SHARE_GPUS=1 $PY -m tray gate peer-barrier -n "$N" --backend cuda --drop $((N - 1)) --json "$OUT/shared_gate_drop.json" ;;
        shared-ep) stage_live shared_ep 240 env TRAY_SHARE_GPUS=1 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128 --routing uniform,zipf --capacity 4 --sms all --gemm ${EP_GEMM:-auto} --repeats 3 --json "$OUT/shared_ep_moe.json" ;;
        shared-tp) stage_live shared_tp 240 env TRAY_SHARE_GPUS=1 $PY -m tray bench tp -n "$N" --backend cuda --sizes 8,1040,65536,4194304 --tokens 1,16 --hidden 1024 --ffn 4096 --repeats 3 --json "$OUT/shared_tp.json" ;;
        shared-nodes2) stage shared_nodes2 240 env TRAY_SHARE_GPUS=1 OUT="$OUT" LOGS="$LOGS" N="$N" PY=$PY scripts/gpu-nodes2.sh ;;
        shared-ep-nodes2) stage_live shared_ep_nodes2 240 env TRAY_SHARE_GPUS=1 $PY -m tray bench ep-moe -n "$N" --nnodes 2 --backend cuda --tokens 128 --routing uniform,zipf --capacity 4 --gemm masked --sms all --repeats 3 --json "$OUT/shared_ep_moe_nodes2.json" ;;
        shared-tp-nodes2) stage_live shared_tp_nodes2 240 env TRAY_SHARE_GPUS=1 $PY -m tray bench tp -n "$N" --nnodes 2 --backend cuda --sizes 8,1040,65536,4194304 --tokens 1,16 --hidden 1024 --ffn 4096 --repeats 3 --json "$OUT/shared_tp_nodes2.json" ;;
        shared-torch) stage shared_torch 240 env TRAY_SHARE_GPUS=1 bash -c torch_stage; mv -f "$OUT/torch.json" "$OUT/shared_torch.json" ;;
        # the GPU tests that start trays (every multi-rank path; the in-process single-GPU ones left out), ~6 s a test
        # at 4 ranks on one H200
        shared-tests) stage shared_tests 540 env TRAY_SHARE_GPUS=1 $PY -m pytest -q -m gpu tests/gpu/test_ep_moe_cuda.py tests/gpu/test_span_barrier_cuda.py tests/gpu/test_torch.py tests/gpu/test_tp_cuda.py tests/gpu/test_tray_cuda.py ${TESTS_K:+-k "$TESTS_K"} ;;
        gate) stage gate 120 $PY -m tray gate peer-barrier -n "$N" --backend cuda --json "$OUT/gate.json" ;;
        stress) stage stress 120 $PY -m tray gate peer-barrier -n "$N" --backend cuda --stress --iters 1000 --replays 9 --json "$OUT/gate_stress.json" ;;
        drop) stage drop 60 $PY -m tray gate peer-barrier -n "$N" --backend cuda --drop $((N - 1)) --json "$OUT/gate_drop.json" ;;
        variants) stage variants 240 $PY bench/barrier_variants.py -n "$N" --json "$OUT/barrier_variants.json" ;;
        # 128 and 4096 tokens/rank, H 7168, top-8 of 256 experts, bf16; uniform and zipf routing; capacity 4x the
        # mean rows per expert (drops counted); peer kernels on every SM and on 24; expert GEMMs driven by the
        # device counts, --gemm $EP_GEMM (default auto: wgmma on H100/H200; ep-moe-cublas: a cuBLAS GEMM per expert
        # over all cap rows instead)
        # (expected ~70 s at 2 ranks; bounded at 240 s). ep-moe-quick: 128 tokens/rank, every SM (expected ~35 s).
        # Every ep-moe stage also times and checks the low-latency mode (one kernel per direction): the keys
        # dispatch_ll, combine_ll, layer_ll under runs[].us.peer*, checks ll_rows_differ_from_ep1, ll_equals_peer
        ep-moe) stage_live ep_moe 240 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128,4096 --routing uniform,zipf --capacity 4 --sms all,24 --gemm ${EP_GEMM:-auto} ${EP_ARGS:-} --json "$OUT/ep_moe.json" --plot "$OUT/ep_moe.png" ;;
        ep-moe-quick) stage_live ep_moe_quick 120 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128 --routing uniform,zipf --capacity 4 --sms all --gemm masked --json "$OUT/ep_moe_quick.json" ;;
        # the layer at 4096 tokens/rank with the Hopper wgmma expert GEMMs (compute capability 9.0), EP-N == EP1 checked
        ep-moe-wgmma) stage_live ep_moe_wgmma 240 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 4096 --routing uniform,zipf --capacity 4 --sms all --gemm wgmma ${EP_ARGS:-} --json "$OUT/ep_moe_wgmma.json" ;;
        ep-moe-cublas) stage_live ep_moe_cublas 240 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128,4096 --routing uniform,zipf --capacity 4 --sms all,24 --gemm cublas ${EP_ARGS:-} --json "$OUT/ep_moe_cublas.json" ;;
        # the NCCL path at the peer path's small SM budget: NCCL limited to 24 CTAs (recorded in the JSON's sms.nccl)
        ep-moe-nccl24) NCCL_MAX_CTAS=24 NCCL_MIN_CTAS=24 stage_live ep_moe_nccl24 240 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128,4096 --routing uniform --capacity 4 --sms 24 --gemm masked --json "$OUT/ep_moe_nccl24.json" ;;
        # where the low-latency kernels' µs go: ep-moe-quick's runs (128 tokens/rank, uniform and zipf, every SM,
        # masked GEMMs), then per rank the diagnosis build of dispatch_ll / combine_ll timed as the production ones
        # and its per-block phase stamps summarized (runs[].ll_phases: span since the first block's entry per
        # boundary, per-block phase µs from SM cycles over the SM clock measured in the run, the build's µs beside
        # the production figure; a printed table per rank). Expected ~40 s at 2 ranks; bounded at 120 s. Run it
        # at 2 ranks with N=2.
        ep-ll-phases) stage_live ep_ll_phases 120 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128 --routing uniform,zipf --capacity 4 --sms all --gemm masked --ll-phases --json "$OUT/ep_moe_ll_phases.json" ;;
        # the capacity a graph must allow with no drop at all (every token of every rank on one expert)
        ep-moe-worst) stage_live ep_moe_worst 120 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128 --routing uniform,zipf --capacity worst --sms all,24 --gemm masked --json "$OUT/ep_moe_worst.json" ;;
        # the FP8 dispatch beside the bf16 one (e4m3 rows + a float32 scale per 128 values, dequantized on the
        # receiver): keys dispatch_fp8, layer_fp8 under runs[].us.peer*, checks fp8_rows_differ_from_ep1_fp8,
        # fp8_vs_bf16_rel_err, fp8_vs_float64_rel_err; then the kernels against the host recipe byte for byte
        ep-moe-fp8) stage_live ep_moe_fp8 300 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128,4096 --routing uniform,zipf --capacity 4 --sms all,24 --gemm masked --dispatch bf16,fp8 --json "$OUT/ep_moe_fp8.json"
            stage ep_moe_fp8_tests 300 $PY -m pytest -q -m gpu tests/gpu/test_ep_moe_cuda.py -k fp8 ;;
        ep-tests) stage ep_tests 300 $PY -m pytest -q -m gpu tests/gpu/test_ep_moe_cuda.py ;;
        ep-moe-fp8-tests) stage ep_moe_fp8_tests 300 $PY -m pytest -q -m gpu tests/gpu/test_ep_moe_cuda.py -k fp8 ;;
        # the NCCL path timed as captured graphs (the default times it eagerly): a hang must end in a SyncTimeout
        # naming the pending program after 30 s; NCCL's registration log shows whether it registered the exported
        # receive buffers at capture. -noreg: the same with NCCL's graph registration off
        ep-moe-nccl-graph) TRAY_SYNC_TIMEOUT_S=30 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG stage_live ep_moe_nccl_graph 150 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128 --routing uniform --capacity 4 --sms all --gemm masked --nccl-timing captured --log-dir "$LOGS/ep_moe_nccl_graph" --json "$OUT/ep_moe_nccl_graph.json" ;;
        ep-moe-nccl-graph-noreg) NCCL_GRAPH_REGISTER=0 TRAY_SYNC_TIMEOUT_S=30 stage_live ep_moe_nccl_graph_noreg 150 $PY -m tray bench ep-moe -n "$N" --backend cuda --tokens 128 --routing uniform --capacity 4 --sms all --gemm masked --nccl-timing captured --json "$OUT/ep_moe_nccl_graph_noreg.json" ;;
        expert-gemm) stage expert_gemm 420 $PY bench/expert_gemm.py ${GEMM_ARGS:-} --json "$OUT/expert_gemm.json" ;;
        # the Hopper wgmma expert GEMMs (compute capability 9.0; ~4 min, bounded at 420 s): their GPU tests on the
        # manifest's plain shapes and the TMA mode (WG_TMA 1: the weights by tensor copies; probes naming the row / k /
        # column of a wrong value, partial tiles vs float64 where the map's zero fill covers rows past N and columns
        # past K, gather vs dense, repeat runs, the warp-specialized and TMA blocks' bytes equal to the plain
        # block's), then the bench at the layer's prefill shape (8192 tokens, EP2 rank, uniform and zipf) with
        # production, wgmma (the manifest's shape), n256s3 (the best plain shape), one warp-specialized shape and the
        # TMA ones (wgmma_tma_*, wgmma_tmap_n256s4: persistent) beside cuBLAS and the read ceiling, every wgmma case
        # checked ($OUT/expert_gemm_wgmma.json; GEMM_ARGS adds). When the tests fail, the warp-specialized and TMA
        # ones run again up to the first failure built to print a bounded mbarrier wait that ran out (which
        # barrier, stage, K tile; the timed build only traps), and the bench leaves those shapes out (a trap ends
        # the process). The layer with --gemm wgmma: stage ep-tests.
        wgmma) stage wgmma_tests 150 $PY -m pytest -q -m gpu tests/gpu/test_wgmma_gemm_cuda.py -k "not ws_" -p no:cacheprovider --tb=short
            wg_only=production,wgmma,wgmma_n256s3,wgmma_ws_n256s4,wgmma_tma_n256s4,wgmma_tma_n256s3,wgmma_tma_n128s6,wgmma_tmap_n256s4
            if tail -n 3 "$LOGS/wgmma_tests.log" | grep -qE "[0-9]+ (failed|error)"; then
                TRAY_WGMMA_HANG_PRINTF=1 stage wgmma_tests_hang 60 $PY -m pytest -q -m gpu tests/gpu/test_wgmma_gemm_cuda.py \
                    -k "tma_ or warp_specialized" -x -p no:cacheprovider --tb=short
                wg_only=production,wgmma,wgmma_n256s3
            fi
            stage expert_gemm_wgmma 210 $PY bench/expert_gemm.py --only "$wg_only" --tokens 8192 --repeats 5 ${GEMM_ARGS:-} \
                --json "$OUT/expert_gemm_wgmma.json" ;;
        # SwiGLU mode of the wgmma gate/up GEMM (one GPU, ~4 min, bounded at 450 s): its GPU tests (act equal to the plain
        # TMA build's h13 through the activation, byte for byte) with the TMA ones, then the bench at the decode and
        # prefill shapes (256 and 8192 tokens: the EP2 rank at 128 and 4096 per rank) with the manifest's shape
        # (`wgmma`: the gate/up GEMM's blocks row tile fastest), the same ring column tile fastest, the 3-stage SwiGLU
        # ring, the plain TMA rings it replaces, and the phases timed again in alternation with cuBLAS over the exact
        # rows ($OUT/expert_gemm_swiglu.json)
        swiglu) stage swiglu_tests 150 $PY -m pytest -q -m gpu tests/gpu/test_wgmma_gemm_cuda.py -k "swiglu or tma_" \
                -p no:cacheprovider --tb=short
            stage expert_gemm_swiglu 300 $PY bench/expert_gemm.py --tokens 256,8192 --repeats 5 \
                --only production,wgmma,wgmma_swiglu_n256s4,wgmma_swiglu_n256s3,wgmma_tma_n256s3,wgmma_tma_n256s4 ${GEMM_ARGS:-} \
                --json "$OUT/expert_gemm_swiglu.json" ;;
        # the experts phase of one rank, EP4 against TP4 on one GPU (the layer's 256 experts, hidden 7168, top-8; 128 and
        # 4096 tokens per rank, so 512 and 16384 tokens in the group): EP4 holds 64 whole experts and computes the rows
        # routed to them; TP4 holds a quarter (expert dim 512) of all 256 and computes every routed row. The same
        # weight bytes per rank; which GEMMs run them faster ($OUT/experts_ep4.json, $OUT/experts_tp4.json; the
        # layers' communication, EP's dispatch and combine against TP's allreduce, needs 4 GPUs)
        experts-ep-tp) stage experts_ep4 240 $PY bench/expert_gemm.py --experts 64 --expert-dim 2048 --tokens 512,16384 \
                --repeats 5 --only production,wgmma,wgmma_swiglu_n256s4 --json "$OUT/experts_ep4.json"
            stage experts_tp4 240 $PY bench/expert_gemm.py --experts 256 --expert-dim 512 --tokens 512,16384 \
                --repeats 5 --only production,wgmma,wgmma_swiglu_n256s4 --json "$OUT/experts_tp4.json" ;;
        # the wgmma expert GEMMs under Nsight Compute (one GPU, ~3 min, bounded at 400 s; the clocks left alone): the
        # layer's two launches at the prefill shape (8192 tokens, uniform), speed of light, memory and compute
        # workload, warp states, then one cuBLAS launch of the baseline for its kernel's name and the same sections
        # ($OUT/gemm_ncu.txt)
        gemm-ncu) ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
            ncu_sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --metrics dram__bytes_read.sum,sm__cycles_active.avg"
            stage gemm_ncu 240 "$ncu_bin" --clock-control none -k regex:ep_wgmma --launch-count 2 $ncu_sections \
                $PY bench/expert_gemm.py --only wgmma --tokens 8192 --routing uniform --repeats 1
            stage gemm_ncu_cublas 160 "$ncu_bin" --clock-control none -k regex:'^(nvjet|sm90|cutlass)' --launch-count 1 \
                $ncu_sections $PY bench/expert_gemm.py --only wgmma --tokens 8192 --routing uniform --repeats 1
            cat "$LOGS/gemm_ncu.log" "$LOGS/gemm_ncu_cublas.log" > "$OUT/gemm_ncu.txt" ;;
        # the sweep 8 B .. 64 MiB: low-latency (timed up to 4 MiB), one-shot, two-shot, NCCL; then the layer
        tp) stage tp 400 $PY -m tray bench tp -n "$N" --backend cuda ${TP_ARGS:-} --json "$OUT/tp.json" ;;
        # every TP path checked after timed graph replays at 2 and 4 ranks on small sizes; the bounded LL wait
        tp-tests) stage tp_tests 540 $PY -m pytest -q -m gpu tests/gpu/test_tp_cuda.py ;;
        tp-ll) stage_live tp_ll 200 $PY -m tray bench tp -n "$N" --backend cuda --sizes 8,16,32,64,128,256,512,1024,2048,4096,8192,16384,32768,65536,131072,262144,524288,1048576 \
                --tokens 1 --hidden 1024 --ffn 4096 --repeats 30 --ll-sweep-bytes 1048576 \
                --ll-shapes 'threads=128,512;lines=1;formats=ll3' --json "$OUT/tp_ll.json"
            stage tp_ll_tests 270 $PY -m pytest -q -m gpu tests/gpu/test_tp_cuda.py -k "every_path or ll3" ;;
        tune) stage tune 190 bash -c tune_stage ;;
        park) stage park 200 $PY -m tray bench park -n "$N" --backend cuda --gib 2 --repeats 3 --json "$OUT/park.json" ;;
        bench-barrier) stage bench_barrier 300 $PY bench/peer_barrier.py -n "$N" --backend cuda --json "$OUT/peer_barrier.json" --plot "$OUT/peer_barrier.png" ;;
        nccl-lifecycle) stage nccl_lifecycle 200 $PY bench/nccl_lifecycle.py --repeats 2 --comms 3 --json "$OUT/nccl_lifecycle.json" ;;
        import-cost) stage import_cost 200 $PY bench/import_cost.py --backend cuda --repeats 5 --json "$OUT/import_cost.json" ;;
        launch-cost) stage launch_cost 120 $PY bench/launch_cost.py --json "$OUT/launch_cost.json" ;;
        # where a tray's end goes: rank.close() -> `tray launch` returned, the program ending normally, by os._exit,
        # or after cuDevicePrimaryCtxReset (bench/teardown.py; $OUT/teardown.json), ~1 min at N=1
        teardown) stage teardown 200 $PY bench/teardown.py -n "$N" --backend cuda --repeats ${TEARDOWN_REPEATS:-5} --json "$OUT/teardown.json" ;;
        bench-startup) stage bench_startup 300 $PY bench/startup.py -n "$N" --backend cuda ${STARTUP_ARGS:---repeats 3} --json "$OUT/startup.json" --plot "$OUT/startup.png" ;;
        torch) stage torch 240 bash -c torch_stage ;;
        examples) stage examples 300 $PY examples/run_all.py --backend cuda first_program allreduce lockstep park_wake user_kernel ;;
        ep-nodes2) NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT stage_live ep_moe_nodes2 300 $PY -m tray bench ep-moe -n "${EP_NODES_N:-2}" --nnodes 2 --backend cuda --tokens 128,4096 --routing uniform,zipf --capacity 4 --gemm masked --sms all ${EP_ARGS:-} --json "$OUT/ep_moe_nodes2.json"
            echo "NCCL as logged by rank 0 (count, ranks, nodes):"; grep -ho "nRanks [0-9]* nNodes [0-9]*" "$LOGS/ep_moe_nodes2.log" | sort | uniq -c ;;
        tp-nodes2) NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT stage_live tp_nodes2 400 $PY -m tray bench tp -n "${TP_NODES_N:-4}" --nnodes 2 --backend cuda --json "$OUT/tp_nodes2.json"
            echo "NCCL as logged by rank 0 (count, ranks, nodes):"; grep -ho "nRanks [0-9]* nNodes [0-9]*" "$LOGS/tp_nodes2.log" | sort | uniq -c ;;
        nodes2) stage nodes2 300 env OUT="$OUT" LOGS="$LOGS" N="$N" PY=$PY scripts/gpu-nodes2.sh ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
