#!/usr/bin/env bash
# Two "nodes" on one GPU machine: two `tray launch --nnodes 2` processes, each over half the GPUs and with
# its own NCCL_HOSTID (so NCCL sees two hosts and talks over its network transport), joined through the
# root on 127.0.0.1 (with TRAY_SHARE_GPUS=1 each node runs over every visible GPU, its ranks sharing them). Runs scripts/nodes2_rank.py; writes $OUT/nodes2.json (every rank's report, NCCL's
# node count) and the two heads' logs. Exit 0 only when both heads exit 0 and every rank reported.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
LOGS="${LOGS:-$OUT}"
N="${N:-4}"
L=$((N / 2))
PY=${PY:-python3}
mkdir -p "$OUT/nodes2" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=INFO
TRAY_JOB_TOKEN=$($PY -c 'import secrets; print(secrets.token_hex(32))')
export TRAY_JOB_TOKEN
PORT=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for node in 0 1; do
    first=$((node * L))
    devices=$(seq -s, "$first" $((first + L - 1)))
    if [ "${TRAY_SHARE_GPUS:-0}" = 1 ]; then  # ranks share GPUs: every node over every visible one
        devices=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(($(nvidia-smi -L | wc -l) - 1)))}
    fi
    CUDA_VISIBLE_DEVICES=$devices NCCL_HOSTID="tray-node-$node" \
        timeout -k 10 240 $PY -m tray launch --nnodes 2 --node-rank "$node" --rdzv-endpoint "127.0.0.1:$PORT" \
        -n "$L" --backend cuda --manifest manifests/peer_fill.json -- $PY scripts/nodes2_rank.py "$OUT/nodes2" \
        > "$LOGS/nodes2-node$node.log" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
grep -h "tray: FAILED\|nNodes" "$LOGS"/nodes2-node*.log | sort | uniq -c | head -20
$PY - "$OUT" "$N" "$rc" "$LOGS" <<'PY'
import json, re, sys
from pathlib import Path
out, n, rc, logs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
ranks = [json.loads(p.read_text()) for p in sorted((out / "nodes2").glob("rank-*.json"))]
text = "".join(p.read_text(errors="replace") for p in logs.glob("nodes2-node*.log"))
nnodes = sorted({int(m) for m in re.findall(r"nNodes (\d+)", text)})
from tray.envinfo import environment
report = {"heads_rc": rc, "ranks_reported": len(ranks), "world_size": n, "nccl_nnodes_seen": nnodes,
          "environment": environment(), "ranks": ranks}
(out / "nodes2.json").write_text(json.dumps(report, indent=2) + "\n")
print(json.dumps({k: v for k, v in report.items() if k != "ranks"}))
for r in ranks:
    print(f"rank {r['rank']} node {r['node_rank']}: barrier world {r['barrier_world_us']:.0f} us, "
          f"pairs {r['barrier_pairs_us']:.1f} us")
    line = f"  spanning barrier: path {r['span_barrier_path']}, relayed {r['span_relayed_us']:.1f} us"
    for key in ("eager", "eager_sync", "captured"):
        if f"span_{key}_us" in r:
            line += f"; {key} {r[f'span_{key}_us']:.1f} us (relayed / {key} = {r[f'span_relayed_over_{key}']:.1f}x)"
    print(line)
paths = sorted({r["span_barrier_path"] for r in ranks})
sys.exit(0 if rc == 0 and len(ranks) == n and paths == ["hierarchical"] else 1)
PY
