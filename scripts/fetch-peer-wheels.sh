#!/usr/bin/env bash
# Fetches what the peer baselines need beyond the GPU machine's PyTorch and transformers, as files
# in .whl/ (git-ignored), for the device tool to carry there (run(carry=[".whl"])): DeepSpeed
# (bench/baselines/deepspeed_offload.py), built here into a wheel without its compiled ops (they
# are built on first use, on the GPU machine), and its dependencies for CPython 3.10-3.13 on
# x86-64 Linux. Needs the Python package index (this machine reaches it; the GPU machine does not).
#   bash scripts/fetch-peer-wheels.sh [DEEPSPEED_VERSION]     (default 0.19.8)
# scripts/gpu-check.sh installs them, when a PEER_MODES entry needs them, into
# $BUILD_DIR/peer-python with pip --no-index --no-deps --find-links .whl, naming the projects.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-0.19.8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dest="$work/whl"  # filled here, then put in place of .whl/ whole: no two versions of a project
mkdir -p "$dest"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip setuptools wheel
"$work/venv/bin/pip" download -q --no-deps --no-binary :all: -d "$work" "deepspeed==$version"
# A pure-Python wheel: DS_BUILD_OPS=0 (the default) leaves the ops to be built where they run. The
# build imports torch only to describe it (PyPI's torch, a few minutes to fetch).
"$work/venv/bin/pip" install -q torch
DS_BUILD_OPS=0 "$work/venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$dest" "$work/deepspeed-$version.tar.gz"
deps=(einops hjson msgpack py-cpuinfo "pydantic>=2" psutil)  # ninja: the GPU machine has the tool
for py in 310 311 312 313; do
  "$work/venv/bin/pip" download -q --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$dest" "${deps[@]}"
done
# flash-linear-attention's kernels (fla-core: pure Python + Triton, which the GPU machine's torch
# brings), the gated delta rule's peer in scripts/bench_gated_delta_torch.py.
"$work/venv/bin/pip" download -q --no-deps -d "$dest" "fla-core==0.6.0"
rm -rf .whl
mv "$dest" .whl
ls -1 .whl
du -sh .whl
