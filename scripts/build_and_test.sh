#!/usr/bin/env bash
# Builds everything (library, CUDA kernels, golden, tests, self-check) and runs the test suite that
# needs no GPU (CUDA tests skip themselves without a device). Installs missing build tools with
# apt-get when run as root on a fresh Debian/Ubuntu machine.
#   MAMBA3_CUDA=OFF  build without the CUDA backend (default ON: needs nvcc)
#   BUILD_DIR=build  build directory;  JOBS=N  parallel jobs (default: all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
MAMBA3_CUDA=${MAMBA3_CUDA:-ON}

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    echo "missing build tools: ${need[*]} (install them, or run as root to let this script do it)" >&2
    exit 1
  fi
fi
if [ "$MAMBA3_CUDA" = ON ] && ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -x $d/nvcc ] && export PATH=$d:$PATH; done
  command -v nvcc >/dev/null || { echo "nvcc not found: install the CUDA toolkit or set MAMBA3_CUDA=OFF" >&2; exit 1; }
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMAMBA3_CUDA="$MAMBA3_CUDA"
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"
