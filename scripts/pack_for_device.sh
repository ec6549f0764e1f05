#!/usr/bin/env bash
# Packs a build made on this machine for a device call, under the device tool's carry limit
# (64 MiB with the working tree), so that the call spends no time building:
#
#   scripts/pack_for_device.sh BUILD_DIR DEST [--tilelang [--upstream-cache OPS]]
#
# DEST (a git-ignored folder of this checkout, e.g. .devpack) receives
#   libmamba3.so.xz        the library, xz-compressed (with the compute_90 PTX it is ~78 MB, ~23 MB
#                          compressed; -DMAMBA3_CUDA_PTX=OFF builds are ~1/5 the size)
#   mamba3_tests, mamba3-selfcheck, mamba3-k3-probe   when BUILD_DIR has them (the *Cuda*
#                          gtests, the self-check, bench/k3_fused_probe.cu)
#   site.tar.xz            with --tilelang: upstream's TileLang kernels' Python packages (the
#                          versions that import on the device image, bench/README.md):
#                          tilelang 0.1.8, apache-tvm-ffi 0.1.5, torch-c-dlpack-ext
#                          0.1.5, z3-solver 4.15.4, unpacked, without what the import does not
#                          need (z3's command-line binary and second copy of libz3, tilelang's
#                          AMD composable_kernel headers): ~31 MB instead of 74 MB of wheels
#   tilelang-cache.tar.xz  with --upstream-cache OPS (bench_mimo_bwd.py --op values, e.g.
#                          combined,combined_norm): upstream's TileLang kernels for those ops at
#                          the 11 grid shapes, compiled here for sm_90a by the benchmark's
#                          --compile-only with the packed tilelang (its library's size and
#                          mtime are in TileLang's cache key), so that the device's compiles
#                          (~200 s per 22 kernels) are cache hits. Needs .upstream
#                          (scripts/extract_upstream.sh) and, in this machine's Python, torch,
#                          triton 3.6, apache-tvm-ffi 0.1.5, torch-c-dlpack-ext 0.1.5 and z3-solver
#                          4.15.4 (the site's own builds are for the device's Python 3.12); ~25-50 s
#                          per kernel on two cores
# and, on the device, `scripts/gpu_check.sh --no-build --build-dir DEST [--tilelang-tar
# DEST/site.tar.xz] [--tilelang-cache-tar DEST/tilelang-cache.tar.xz]` unpacks them (carry
# DEST, and .upstream for the comparisons: ~0.6 MB).
# The wheels come from PyPI (pip download, cp312, manylinux x86_64: the device image's Python);
# packing takes about a minute on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,32p' "$0" >&2
  exit 2
fi
BUILD=$1 DEST=$2 TILELANG=0 UPCACHE_OPS=
shift 2
while [ $# -gt 0 ]; do
  case $1 in
    --tilelang) TILELANG=1 ;;
    --upstream-cache) UPCACHE_OPS=$2; shift ;;
    *) echo "pack_for_device.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$UPCACHE_OPS" ] && { [ "$TILELANG" = 0 ] || [ ! -d .upstream ]; }; then
  echo "pack_for_device.sh: --upstream-cache needs --tilelang and .upstream" >&2
  exit 2
fi
if [ ! -f "$BUILD/libmamba3.so" ]; then
  echo "pack_for_device.sh: $BUILD/libmamba3.so not found" >&2
  exit 1
fi
# (Made first: an ignore pattern for folders, `.dev*/`, matches only a folder that exists.)
mkdir -p "$DEST"
if ! git check-ignore -q "$DEST"; then
  rmdir "$DEST" 2>/dev/null || true
  echo "pack_for_device.sh: $DEST is not git-ignored (add it to .git/info/exclude): a carried" \
       "folder must not be committed" >&2
  exit 1
fi

xz -T0 -6 -c "$BUILD/libmamba3.so" > "$DEST/libmamba3.so.xz"
rm -f "$DEST/libmamba3.so"  # gpu_check.sh unpacks the .xz only where no library is there
for f in mamba3_tests mamba3-selfcheck mamba3-k3-probe; do
  if [ -x "$BUILD/$f" ]; then cp "$BUILD/$f" "$DEST/"; fi
done

if [ "$TILELANG" = 1 ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for w in tilelang==0.1.8 apache-tvm-ffi==0.1.5 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp/whl" "$w"
  done
  # A wheel is a zip of its installed tree (purelib / platlib): unzipping it is what
  # `pip install --target` does for these four, without needing this machine's Python to match.
  mkdir -p "$tmp/site"
  for w in "$tmp"/whl/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
  rm -rf "$tmp"/site/z3_solver-*.data "$tmp/site/tilelang/3rdparty/composable_kernel"
  if cmp -s "$tmp/site/z3/lib/libz3.so" "$tmp/site/z3/lib/libz3.so.4.15"; then
    ln -sf libz3.so "$tmp/site/z3/lib/libz3.so.4.15"
  fi
  tar -C "$tmp/site" -cf - . | xz -T0 -6 > "$DEST/site.tar.xz"
  if [ -n "$UPCACHE_OPS" ]; then
    # tilelang itself from the packed site (unzip kept the wheel's mtimes, tar keeps them on
    # the device), the other packages from this machine's Python.
    mkdir -p "$tmp/tl" "$tmp/cache"
    ln -s "$tmp/site/tilelang" "$tmp/tl/tilelang"
    rc=0
    PYTHONPATH="$tmp/tl:python" MAMBA3_LIBRARY="$BUILD/libmamba3.so" \
      TILELANG_CACHE_DIR="$tmp/cache" python3 bench/bench_mimo_bwd.py --compile-only \
      --op "$UPCACHE_OPS" > "$tmp/compile.log" 2>&1 || rc=$?
    grep -v -e ' Warning: ' -e 'TileLang:tilelang.jit.kernel:INFO' "$tmp/compile.log" || true
    [ "$rc" = 0 ] || echo "pack_for_device.sh: not every upstream kernel compiled (rc $rc):" \
                         "the device compiles the rest" >&2
    tar -C "$tmp/cache" -cf - . | xz -T0 -6 > "$DEST/tilelang-cache.tar.xz"
  fi
fi

# What a call carries besides DEST: the tracked files, the untracked ones git does not ignore
# (a build folder left unignored counts in full: session 41's calls were refused for it) and
# .upstream (scripts/extract_upstream.sh), which the comparisons carry too.
tree=$(git ls-files -z --cached --others --exclude-standard |
       du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
up=0
[ -d .upstream ] && up=$(du -sb .upstream | cut -f1)
carry=$(du -sb "$DEST" | cut -f1)
total=$(( tree + up + carry ))
echo "packed $DEST: $(( carry / 1048576 )) MiB (+ $(( tree / 1048576 )) MiB of the working tree," \
     "$(( up / 1024 )) KiB of .upstream: $(( total / 1048576 )) of the 64 MiB a call carries)"
ls -la "$DEST"
if [ "$total" -gt $(( 64 * 1048576 )) ]; then
  echo "pack_for_device.sh: over the carry limit: carry DEST without site.tar.xz and unpack" \
       "tilelang in a call of its own, or build with -DMAMBA3_CUDA_PTX=OFF" >&2
  exit 3
fi
