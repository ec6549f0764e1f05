#!/usr/bin/env bash
# Builds only the torch extension mamba3_kernels._C (src/torch_ext/binding.cpp, one C++ file, no
# nvcc) against the torch of the Python in PATH and an existing libmamba3.so: for a machine whose
# torch differs from the one the library was built next to (an extension is tied to the torch
# version it was compiled against).
#
#   scripts/build_torch_ext.sh BUILD_DIR [LIBMAMBA3]
#
# LIBMAMBA3 defaults to $MAMBA3_LIBRARY, else BUILD_DIR/libmamba3.so. The module is written to
# BUILD_DIR/_C<python extension suffix> (rpath: its own directory, then the library's), and its path
# is the last line printed. Use it with
#   MAMBA3_LIBRARY=LIBMAMBA3 MAMBA3_TORCH_EXT=BUILD_DIR/_C....so PYTHONPATH=python python ...
# (with PYTHONPATH=python alone the package also finds it next to a build*/libmamba3.so of this
# checkout). PYTHON=... selects another interpreter. Uses CMake (src/torch_ext/CMakeLists.txt)
# when available (USE_CMAKE=0: never), else g++ directly with the same flags.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: $0 BUILD_DIR [LIBMAMBA3]" >&2
  exit 2
fi
mkdir -p "$1"
BUILD_DIR=$(cd "$1" && pwd)
LIB=${2:-${MAMBA3_LIBRARY:-$BUILD_DIR/libmamba3.so}}
[ -f "$LIB" ] || { echo "libmamba3.so not found: $LIB (give it as the second argument)" >&2; exit 1; }
LIB=$(cd "$(dirname "$LIB")" && pwd)/$(basename "$LIB")
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
"$PYTHON" -c "import torch" 2>/dev/null || { echo "$PYTHON cannot import torch" >&2; exit 1; }

if [ "${USE_CMAKE:-1}" = 1 ] && command -v cmake >/dev/null; then
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S src/torch_ext -B "$BUILD_DIR/torch_ext" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DMAMBA3_LIBRARY="$LIB" -DPython_EXECUTABLE="$PYTHON" \
        -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$BUILD_DIR" >/dev/null
  cmake --build "$BUILD_DIR/torch_ext" -j "${JOBS:-$(nproc)}"
  suffix=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
else
  # The flags of cmake/Mamba3TorchExt.cmake, without CMake.
  eval "$("$PYTHON" - <<'PY'
import shlex, sysconfig
import torch
import warnings
warnings.simplefilter("ignore")
import torch.utils.cpp_extension as ce
flags = getattr(ce, "_get_pybind11_abi_build_flags", lambda: [])()
inc = ce.include_paths() + [sysconfig.get_paths()["include"]]
print("incs=" + shlex.quote(" ".join("-isystem " + shlex.quote(p) for p in inc)))
print("libdir=" + shlex.quote(ce.library_paths()[0]))
print("abi=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
print("tver=" + shlex.quote(torch.__version__))
print("defs=" + shlex.quote(" ".join(shlex.quote(f) for f in flags)))
print("suffix=" + shlex.quote(sysconfig.get_config_var("EXT_SUFFIX")))
PY
)"
  libdir_m3=$(dirname "$LIB")
  # shellcheck disable=SC2086
  eval "${CXX:-g++}" -std=c++20 -O2 -fPIC -shared -fvisibility=hidden -Wall -Wextra \
    -D_GLIBCXX_USE_CXX11_ABI=$abi -DTORCH_EXTENSION_NAME=_C \
    "'-DMAMBA3_TORCH_VERSION_STRING=\"$tver\"'" $defs $incs \
    -Iinclude -Ithird_party/dlpack/include src/torch_ext/binding.cpp \
    -o "'$BUILD_DIR/_C$suffix'" "'$LIB'" -L"'$libdir'" -lc10 -ltorch -ltorch_cpu -ltorch_python \
    "'-Wl,-rpath,\$ORIGIN:$libdir_m3:$libdir'"
fi
out="$BUILD_DIR/_C$suffix"
[ -f "$out" ] || { echo "build did not produce $out" >&2; exit 1; }
MAMBA3_LIBRARY="$LIB" MAMBA3_TORCH_EXT="$out" PYTHONPATH=python "$PYTHON" -c \
  "import mamba3_kernels as m; assert m.binding() == 'compiled'" \
  || { echo "$out does not load (see above)" >&2; exit 1; }
echo "$out"
