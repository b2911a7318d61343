#!/usr/bin/env bash
# One tray on one host: every visible GPU (or -n N) runs one rank of PROGRAM.
#
#   launch/single-host.sh [-n N] [--manifest NAME_OR_PATH] -- python my_program.py ARGS...
#   launch/single-host.sh --gate            # qualify the box first: the peer-barrier gate on every GPU
#
# Sets the environment every tray on these machines runs with (multicast/NVLS off: tray never uses
# NVLink multicast, and NCCL, torch symmetric memory and NVSHMEM must not either), then execs
# `tray launch`. Extra `tray launch` options (--log-dir, --var, --timeout-s ...) pass through.
set -euo pipefail

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

PY="${PYTHON:-python3}"
# tray's launcher with its dependencies, not merely a tray/ directory that happens to be the current one
if ! "$PY" -c "import tray.launch.head" 2>/dev/null; then
    echo "launch/single-host.sh: 'import tray.launch.head' fails for $PY (tray or one of its dependencies is" \
         "missing); pip install 'tray[gpu]', or in a checkout run make and set PYTHON=.venv/bin/python" >&2
    exit 2
fi

if [ "${1:-}" = "--gate" ]; then
    shift
    exec "$PY" -m tray gate peer-barrier "$@"
fi
exec "$PY" -m tray launch "$@"
