#!/usr/bin/env bash
# Carry the Python packages the GPU machine lacks (it has no network) as wheels.
#
#   scripts/gpu-wheels.sh download   # here, with network: py3.12 manylinux x86_64 wheels + tray's own into .whl/
#   scripts/gpu-wheels.sh install    # there: pip install --no-index --target "$TRAY_GPU_SITE"
#   eval "$(scripts/gpu-wheels.sh env)"   # there: PYTHONPATH = that site (not the checkout), its bin on PATH
#
# The GPU machine already has cuda-bindings, cuda-core, cuda-pathfinder, numpy, msgpack, psutil,
# ml-dtypes, safetensors, pytest, hypothesis and the NCCL (nvidia-nccl-cu13, 2.28.9), cuBLAS, NVRTC
# and CUDA runtime library wheels: never carry those (the NCCL wheel alone is ~200 MB).
# The project itself travels as its own wheel (built here from the checkout) and is installed there like
# the others, so GPU runs exercise the installed package, not the source tree.
set -euo pipefail

# One pinned version of each. nccl4py 0.6.0: raw bindings (nccl.bindings.nccl) generated from NCCL
# 2.32 headers, loading the libnccl.so.2 that is there (2.28.9) at first call; needs cuda-core~=1.0,
# cuda-pathfinder>=1.5.4 and (cu13) cuda-bindings~=13.0. nvmath-python 1.0.0: cuBLAS bindings for
# cuda-bindings 13 / CUDA 13. packaging: a plain Requires-Dist of nccl4py (nccl.core) not on the list
# of what the GPU machine is known to have.
PINS=(
    "pyzmq==27.3.0"
    "nccl4py==0.6.0"
    "nvmath-python==1.0.0"
    "packaging==26.4"
)
# Requirements (without an extra) that the GPU machine already satisfies.
PRESENT="cuda-bindings cuda-core cuda-pathfinder numpy msgpack psutil ml-dtypes safetensors pytest
hypothesis nvidia-nccl-cu13 nvidia-cublas nvidia-cuda-nvrtc nvidia-cuda-runtime"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="$REPO/.whl"
SITE="${TRAY_GPU_SITE:-/tmp/tray-site}"

usage() {
    echo "usage: $0 download|install|env" >&2
    echo "  download  (with network) fetch the pinned cp312 manylinux x86_64 wheels and build tray's into .whl/" >&2
    echo "  install   (GPU machine, offline) install .whl/*.whl into \$TRAY_GPU_SITE (default /tmp/tray-site)" >&2
    echo "  env       print the export line that puts that site on PYTHONPATH and its bin/ on PATH" >&2
    exit 2
}

source_digest() {  # what tray's wheel was built from: every file under tray/ and manifests/, hashed
    (cd "$REPO" && find -L tray manifests -type f ! -path '*__pycache__*' ! -name '*.pyc' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}

env_line() {
    echo "export PYTHONPATH=\"$SITE\${PYTHONPATH:+:\$PYTHONPATH}\" PATH=\"$SITE/bin:\$PATH\""
}

download() {
    mkdir -p "$WHL"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$WHL" "${PINS[@]}"
    # Keep exactly the pinned versions: drop wheels of other versions left by an earlier pin.
    python3 - "$WHL" "$PRESENT" "${PINS[@]}" <<'EOF'
import pathlib
import re
import sys
import zipfile

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

whl, present, pins = pathlib.Path(sys.argv[1]), set(sys.argv[2].split()), sys.argv[3:]
wanted = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
found = {}
for f in sorted(whl.glob("*.whl")):
    name, version = f.name.split("-")[:2]
    if norm(name) == "tray":
        continue  # rebuilt below
    if wanted.get(norm(name)) != version:
        print(f"removing {f.name} (not a pinned version)")
        f.unlink()
        continue
    found[norm(name)] = f
missing = sorted(set(wanted) - set(found))
if missing:
    sys.exit(f"error: no wheel downloaded for {', '.join(missing)}")
# Every unconditional requirement must be pinned here or already on the GPU machine.
unmet = []
for f in found.values():
    with zipfile.ZipFile(f) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req or "pypy" in req or "Windows" in req:
            continue
        dep = norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
        if dep not in wanted and dep not in present:
            unmet.append(f"{f.name}: {req}")
if unmet:
    sys.exit("error: requirements neither pinned nor on the GPU machine:\n  " + "\n  ".join(unmet))
EOF
    # tray's own wheel, from this checkout (no dependencies: they are pinned above or already there)
    # built from a clean copy: an in-tree build would leave build/ behind and could pack its stale files
    rm -f "$WHL"/tray-*.whl
    local src
    src="$(mktemp -d)"
    cp -a "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/tray" "$REPO/manifests" "$src/"
    find "$src" -name __pycache__ -prune -exec rm -rf {} +
    python3 -m pip wheel -q --no-deps -w "$WHL" "$src"
    rm -rf "$src"
    source_digest > "$WHL/tray-source.sha256"
    ls -l "$WHL"/*.whl
    du -ch "$WHL"/*.whl | tail -1
}

install() {
    shopt -s nullglob
    local wheels=("$WHL"/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "error: no wheels in $WHL; run '$0 download' on a machine with network first" >&2
        exit 1
    fi
    # NOTE: the GPU machine cannot build wheels (no network for the build backend): refuse a tray wheel
    # built from other sources than this checkout's, so a GPU run never tests stale code
    if [ "$(cat "$WHL/tray-source.sha256" 2>/dev/null)" != "$(source_digest)" ]; then
        echo "error: .whl/tray-*.whl was not built from this checkout's tray/ and manifests/;" \
             "run 'make gpu-wheels' here again and carry .whl/" >&2
        exit 1
    fi
    # NOTE: compiled to bytecode here, as any pip install does: that machine runs with PYTHONDONTWRITEBYTECODE=1,
    # so a site without .pyc compiles every module at every start of every process (the startup figures of
    # bench/results/h200/startup*.json were measured that way; those under startup_ab/ with bytecode)
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
    echo "installed ${#wheels[@]} wheels (tray's own among them) into $SITE" >&2
    echo "run this, or eval \"\$($0 env)\"; run Python with -P (or outside the checkout) so that the" >&2
    echo "checkout's tray/ does not shadow the installed one:" >&2
    env_line
}

case "${1:-}" in
    download) download ;;
    install) install ;;
    env) env_line ;;
    *) usage ;;
esac
