#!/usr/bin/env bash
# The wheels benchmarks/gpu_run.sh carries to a device machine whose python3 (3.12) lacks them and
# which reaches no package registry: fla-core (fla's Triton kernels, pure Python) and its einops,
# blake3 (the engine's media hash; compiled, so the cp312 manylinux build), av and torchcodec (02b_decode),
# xgrammar (04_structured; with apache-tvm-ffi, pydantic, pydantic-core, annotated-types, typing-extensions
# and typing-inspection). Run here, once, with network:
#   bash benchmarks/gpu_wheels.sh [DEST=.whl] [PYTHON_VERSION=3.12]
# .whl/ is git-ignored (.gitignore): it never enters the repository; the device tool carries it.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYV=${2:-3.12}
mkdir -p "$DEST"
python3 -m pip download -q --no-deps -d "$DEST" fla-core==0.6.0 einops
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_17_x86_64 -d "$DEST" blake3 av
# 04_structured: xgrammar alone (its torch / transformers / triton are the device's), then its tvm-ffi and pydantic
# with their dependencies (pydantic-core's build pinned by pydantic; its wheels are tagged manylinux_2_17)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$DEST" xgrammar
python3 -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" apache-tvm-ffi pydantic
# 02b_decode (GPU decode): TorchCodec built for the device's torch and CUDA (TORCHCODEC_INDEX, e.g.
# https://download.pytorch.org/whl/cu128); it loads FFmpeg's shared libraries from the system, so on a
# device without them the step says so in one line and is skipped
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$DEST" ${TORCHCODEC_INDEX:+--index-url "$TORCHCODEC_INDEX"} torchcodec
ls -l "$DEST"
