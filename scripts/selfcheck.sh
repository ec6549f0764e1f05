#!/usr/bin/env bash
# The main job: builds if needed, then runs mamba3-selfcheck on the default device (CUDA if
# present, else CPU): every operator against the float64 golden, accuracy table and timings.
# Extra arguments go to mamba3-selfcheck (--device cpu|cuda, --quick, --output FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
if [ ! -x "$BUILD_DIR/mamba3-selfcheck" ]; then
  if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do [ -x $d/nvcc ] && export PATH=$d:$PATH; done
  fi
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMAMBA3_CUDA="${MAMBA3_CUDA:-ON}" >/dev/null
  cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target mamba3-selfcheck
fi
exec "$BUILD_DIR/mamba3-selfcheck" "$@"
