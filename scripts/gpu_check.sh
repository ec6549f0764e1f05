#!/usr/bin/env bash
# The one call on the GPU machine: build, C++ tests, self-check, Python tests, benchmark.
# Every log goes under $OUT (default ./gpu_out); a summary table (pass/fail per phase, then the
# benchmark table) is printed last. A phase that fails does not stop the later ones.
#
#   scripts/gpu_check.sh [options]
#     --no-build        use the existing build directory (e.g. carried to the machine; a
#                       folder of carried binaries without a build tree runs the *Cuda* gtests)
#     --build-dir DIR   build directory (default: build)
#     --tests-only      build (unless --no-build), ctest, self-check, pytest; no benchmark
#     --bench-only      build (unless --no-build) and benchmark only
#     --no-ctest / --no-selfcheck / --no-pytest / --no-bench   skip one phase
#     --pip             test an installed package (pip install --no-build-isolation --no-deps
#                       into a temporary target) instead of PYTHONPATH=python + MAMBA3_LIBRARY
#     --quick-bench     fewer benchmark repetitions
#     --pytest-args "..."  extra pytest arguments (e.g. "-k dqktheta -x")
#     --gtest-filter PAT  the carried binaries' GoogleTest filter (default '*Cuda*')
#     --budget SECONDS  total wall-clock budget (default 570): each phase's timeout is cut so
#                       that the summary is still printed before the budget runs out
#   MIMO (the MIMO backward; off by default: the SISO phases above are unchanged, except that
#   the MIMO CUDA test file is left out of their pytest run):
#     --mimo            after the SISO phases, run the MIMO phases: pytest-mimo
#                       (tests/python/test_mimo_*.py) and bench-mimo (bench/bench_mimo_bwd.py
#                       --op all: bwd_fwd, bwd_bwd and combined, three tables; needs --budget
#                       ~900 with everything else on)
#     --mimo-only       the MIMO phases instead of the SISO pytest and benchmark phases
#     --mimo-bench-args "..."  extra benchmark arguments (e.g. "--shapes 0,3 --quick"; an --op
#                       there replaces the default --op all; without --compile-timeout there,
#                       upstream's compiles get about half of the phase's time limit)
#     --tilelang-site DIR  prepended to PYTHONPATH of the MIMO benchmark only, where tilelang
#                       was installed (pip install --no-index --no-deps --target DIR ...);
#                       default $TILELANG_SITE. Without tilelang the benchmark says so and
#                       compares with the float32 torch reference instead of upstream.
#     --tilelang-tar FILE  the site folder packed by scripts/pack_for_device.sh --tilelang:
#                       unpacked to a temporary folder, used as --tilelang-site
#     --tilelang-cache-tar FILE  upstream's kernels compiled on the packing machine
#                       (pack_for_device.sh --upstream-cache): unpacked into TILELANG_CACHE_DIR,
#                       so that the benchmark's upstream compiles are cache hits
#   With --no-build, a build directory that holds libmamba3.so.xz but no libmamba3.so (made by
#   scripts/pack_for_device.sh) gets the library unpacked first. With either benchmark phase on,
#   the build directory's mamba3-k3-probe (bench/k3_fused_probe.cu) runs too (seconds).
set -o pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
export OUT  # the benchmark writes its JSON and table there
PY=${PYTHON:-python3}
# Triton's compiled kernels and upstream's autotuning results (the benchmark autotunes upstream's
# kernels: 27-81 configurations per key) are kept in an ignored folder of the checkout, which
# survives between calls on a machine that stays warm: a second benchmark run skips that work.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/build-triton-cache}
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
# TileLang's compiled kernels (upstream's MIMO kernel, one per benchmark shape), likewise.
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$ROOT/build-tilelang-cache}

BUILD_DIR=build
DO_BUILD=1 DO_CTEST=1 DO_SELFCHECK=1 DO_PYTEST=1 DO_BENCH=1 USE_PIP=0 QUICK_BENCH=0
PYTEST_ARGS=""
GTEST_FILTER='*Cuda*'
BUDGET=570
DO_MIMO=0 MIMO_ONLY=0 MIMO_BENCH_ARGS="" TILELANG_SITE=${TILELANG_SITE:-} TILELANG_TAR=
TILELANG_CACHE_TAR=
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) DO_BUILD=0 ;;
    --build-dir) BUILD_DIR=$2; shift ;;
    --tests-only) DO_BENCH=0 ;;
    --bench-only) DO_CTEST=0 DO_SELFCHECK=0 DO_PYTEST=0 ;;
    --no-ctest) DO_CTEST=0 ;;
    --no-selfcheck) DO_SELFCHECK=0 ;;
    --no-pytest) DO_PYTEST=0 ;;
    --no-bench) DO_BENCH=0 ;;
    --pip) USE_PIP=1 ;;
    --quick-bench) QUICK_BENCH=1 ;;
    --pytest-args) PYTEST_ARGS=$2; shift ;;
    --gtest-filter) GTEST_FILTER=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    --mimo) DO_MIMO=1 ;;
    --mimo-only) DO_MIMO=1 MIMO_ONLY=1 ;;
    --mimo-bench-args) MIMO_BENCH_ARGS=$2; shift ;;
    --tilelang-site) TILELANG_SITE=$2; shift ;;
    --tilelang-tar) TILELANG_TAR=$2; shift ;;
    --tilelang-cache-tar) TILELANG_CACHE_TAR=$2; shift ;;
    -h|--help) sed -n '2,41p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac

START=$(date +%s)
NPROC=$(nproc)
declare -a SUMMARY=()
FAILED=0

# Seconds a phase may take: its own limit, cut to what is left of the budget minus a reserve
# for the summary.
phase_limit() {
  local want=$1 left
  left=$(( BUDGET - ($(date +%s) - START) - 20 ))
  [ "$left" -lt 10 ] && left=10
  [ "$want" -lt "$left" ] && echo "$want" || echo "$left"
}

# run_phase NAME LOGFILE LIMIT_SECONDS COMMAND...: output to the log and to the console.
run_phase() {
  local name=$1 log=$2 limit t0 rc dt
  limit=$(phase_limit "$3")
  shift 3
  echo "=== [$name] $* (limit ${limit}s, log $log)"
  t0=$(date +%s)
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  dt=$(( $(date +%s) - t0 ))
  local status=PASS
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ]; then status="TIMEOUT"; fi
  if [ "$rc" -ne 0 ] && [ "$status" = PASS ]; then status="FAIL(rc=$rc)"; fi
  [ "$status" = PASS ] || FAILED=1
  SUMMARY+=("| $name | $status | ${dt}s | $(basename "$log") |")
  echo "=== [$name] $status in ${dt}s"
  return "$rc"
}

skip_phase() { SUMMARY+=("| $1 | skipped: $2 | | |"); }

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -2
  cmake --version | head -1
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
  git -C "$ROOT" log -1 --format='commit %H %s' 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ------------------------------------------------------------------ build
BUILD_OK=1
if [ "$DO_BUILD" = 1 ]; then
  TESTS=ON
  [ "$DO_CTEST" = 1 ] || TESTS=OFF
  run_phase configure "$OUT/configure.log" 120 \
    cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMAMBA3_CUDA=ON \
      -DMAMBA3_BUILD_TESTS=$TESTS -DMAMBA3_BUILD_TOOLS=ON -DMAMBA3_TORCH_EXT=OFF || BUILD_OK=0
  if [ "$BUILD_OK" = 1 ]; then
    run_phase build "$OUT/build.log" 420 cmake --build "$BUILD_DIR" -j "$NPROC" || BUILD_OK=0
  else
    skip_phase build "configure failed"
  fi
else
  skip_phase build "--no-build ($BUILD_DIR)"
fi
LIB=$BUILD_DIR/libmamba3.so
if [ "$DO_BUILD" = 0 ] && [ ! -f "$LIB" ] && [ -f "$LIB.xz" ]; then
  xz -dk "$LIB.xz" || echo "gpu_check.sh: could not unpack $LIB.xz" >&2
fi
if [ -n "$TILELANG_TAR" ]; then
  TILELANG_SITE=$(mktemp -d)
  trap 'rm -rf "$TILELANG_SITE"' EXIT
  tar -xJf "$TILELANG_TAR" -C "$TILELANG_SITE" ||
    echo "gpu_check.sh: could not unpack $TILELANG_TAR (the MIMO benchmark then runs" \
         "without upstream)" >&2
fi
if [ -n "$TILELANG_CACHE_TAR" ]; then
  mkdir -p "$TILELANG_CACHE_DIR"
  tar -xJf "$TILELANG_CACHE_TAR" -C "$TILELANG_CACHE_DIR" ||
    echo "gpu_check.sh: could not unpack $TILELANG_CACHE_TAR (upstream compiles on the device)" >&2
fi
if [ ! -f "$LIB" ]; then
  echo "gpu_check.sh: $LIB does not exist" >&2
  BUILD_OK=0
fi

# ------------------------------------------------------------------ C++ tests and self-check
if [ "$DO_CTEST" = 1 ]; then
  if [ -x "$BUILD_DIR/mamba3_tests" ] && [ -f "$BUILD_DIR/CTestTestfile.cmake" ]; then
    run_phase ctest "$OUT/ctest.log" 240 \
      ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$NPROC" \
        --output-junit "$OUT/ctest.xml"
  elif [ -x "$BUILD_DIR/mamba3_tests" ]; then
    # Carried binaries (built elsewhere, no build tree): the GPU tests only; CI runs the rest.
    run_phase gtest-cuda "$OUT/gtest_cuda.log" 300 \
      env LD_LIBRARY_PATH="$BUILD_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$BUILD_DIR/mamba3_tests" --gtest_filter="$GTEST_FILTER" --gtest_output="xml:$OUT/gtest_cuda.xml"
  else
    skip_phase ctest "mamba3_tests not built (GoogleTest missing?)"
  fi
fi
if [ "$DO_SELFCHECK" = 1 ]; then
  if [ -x "$BUILD_DIR/mamba3-selfcheck" ]; then
    run_phase selfcheck "$OUT/selfcheck.log" 240 \
      "$BUILD_DIR/mamba3-selfcheck" --device cuda --output "$OUT/selfcheck.md"
  else
    skip_phase selfcheck "mamba3-selfcheck not built"
  fi
fi

# ------------------------------------------------------------------ Python
if [ "$USE_PIP" = 1 ] && { [ "$DO_PYTEST" = 1 ] || [ "$DO_BENCH" = 1 ]; }; then
  PIP_TARGET=$(mktemp -d)
  if run_phase pip-install "$OUT/pip_install.log" 420 \
      "$PY" -m pip install --no-build-isolation --no-deps --no-index --target "$PIP_TARGET" \
        "$ROOT" -Cbuild-dir="$BUILD_DIR-wheel"; then
    export PYTHONPATH=$PIP_TARGET${PYTHONPATH:+:$PYTHONPATH}
    unset MAMBA3_LIBRARY
  else
    DO_PYTEST=0 DO_BENCH=0
    skip_phase pytest "pip install failed"
  fi
else
  export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
  export MAMBA3_LIBRARY=$LIB
  # The compiled SISO binding mamba3_kernels._C, in its own phase against this Python's torch
  # (the build above leaves it out, so that a failure here costs only this phase: the Python
  # phases then run the ctypes binding, and the run is marked failed). Skipped when BUILD_DIR
  # already has a module that loads into this torch.
  if [ "$BUILD_OK" = 1 ] && { [ "$DO_PYTEST" = 1 ] || [ "$DO_BENCH" = 1 ]; } &&
     [ "$("$PY" -c 'import mamba3_kernels as m; print(m.binding())' 2>/dev/null)" != compiled ]; then
    run_phase torch-ext "$OUT/torch_ext.log" 180 \
      env PYTHON="$(command -v "$PY")" "$ROOT/scripts/build_torch_ext.sh" "$BUILD_DIR" "$LIB"
  fi
fi
echo "python binding: $("$PY" -c 'import mamba3_kernels as m; print(m.binding())' 2>&1 | tail -1)" \
  | tee -a "$OUT/env.txt"

# The MIMO tests run in their own phase (--mimo); the SISO phase leaves them out.
# (Without --mimo only the MIMO CUDA files are left out; with it, every MIMO file moves there.)
MIMO_TESTS=()
for f in "$ROOT"/tests/python/test_mimo_*.py; do
  case "$f" in *_cuda.py) MIMO_TESTS+=("$f") ;; *) [ "$DO_MIMO" = 1 ] && MIMO_TESTS+=("$f") ;; esac
done
MIMO_IGNORE=()
for f in "${MIMO_TESTS[@]}"; do MIMO_IGNORE+=("--ignore=$f"); done
if [ "$MIMO_ONLY" = 1 ]; then
  DO_PYTEST_MIMO=$DO_PYTEST DO_BENCH_MIMO=$DO_BENCH
  DO_PYTEST=0 DO_BENCH=0
else
  DO_PYTEST_MIMO=$(( DO_MIMO && DO_PYTEST )) DO_BENCH_MIMO=$(( DO_MIMO && DO_BENCH ))
fi

if [ "$DO_PYTEST" = 1 ]; then
  if [ "$USE_PIP" = 1 ] || [ "$BUILD_OK" = 1 ]; then
    # shellcheck disable=SC2086
    run_phase pytest "$OUT/pytest.log" 330 \
      "$PY" -m pytest "$ROOT/tests/python" -q -rfE --durations=20 -p no:cacheprovider \
        --junitxml="$OUT/pytest.xml" "${MIMO_IGNORE[@]}" $PYTEST_ARGS
  else
    skip_phase pytest "no library"
  fi
fi

BENCH_TABLE=""
if [ "$DO_BENCH" = 1 ]; then
  if [ "$USE_PIP" = 1 ] || [ "$BUILD_OK" = 1 ]; then
    BENCH_ARGS=()
    [ "$QUICK_BENCH" = 1 ] && BENCH_ARGS+=(--quick)
    run_phase bench "$OUT/bench.log" 360 \
      "$PY" "$ROOT/bench/bench_siso_bwd.py" "${BENCH_ARGS[@]}"
    [ -f "$OUT/bench_siso_bwd.md" ] && BENCH_TABLE=$(cat "$OUT/bench_siso_bwd.md")
  else
    skip_phase bench "no library"
  fi
fi

# ------------------------------------------------------------------ MIMO
if [ "$DO_PYTEST_MIMO" = 1 ]; then
  if [ "$USE_PIP" = 1 ] || [ "$BUILD_OK" = 1 ]; then
    # shellcheck disable=SC2086
    run_phase pytest-mimo "$OUT/pytest_mimo.log" 240 \
      "$PY" -m pytest "$ROOT"/tests/python/test_mimo_*.py -q -rfE --durations=15 \
        -p no:cacheprovider --junitxml="$OUT/pytest_mimo.xml" $PYTEST_ARGS
  else
    skip_phase pytest-mimo "no library"
  fi
fi
MIMO_BENCH_TABLE=""
if [ "$DO_BENCH_MIMO" = 1 ]; then
  if [ "$USE_PIP" = 1 ] || [ "$BUILD_OK" = 1 ]; then
    MB_ARGS=()
    [ "$QUICK_BENCH" = 1 ] && MB_ARGS+=(--quick)
    # shellcheck disable=SC2206
    [ -n "$MIMO_BENCH_ARGS" ] && MB_ARGS+=($MIMO_BENCH_ARGS)
    case " $MIMO_BENCH_ARGS " in *" --op "*|*" --op="*) ;; *) MB_ARGS+=(--op all) ;; esac
    # The phase's limit (three ops: upstream's compiles of up to 33 kernels, then the timing);
    # the compiles are given up after ~55% of it so that the timing and the tables still fit.
    MB_LIMIT=$(phase_limit 600)
    case " $MIMO_BENCH_ARGS " in
      *" --compile-timeout"*) ;;
      *) MB_ARGS+=(--compile-timeout $(( MB_LIMIT * 55 / 100 ))) ;;
    esac
    MB_PYTHONPATH=$PYTHONPATH
    if [ -n "$TILELANG_SITE" ]; then
      if [ -d "$TILELANG_SITE" ]; then
        MB_PYTHONPATH=$TILELANG_SITE${PYTHONPATH:+:$PYTHONPATH}
      else
        echo "gpu_check.sh: --tilelang-site $TILELANG_SITE does not exist" >&2
      fi
    fi
    # Tables of an earlier run in $OUT are not shown as this run's.
    rm -f "$OUT"/bench_mimo_bwd.md "$OUT"/bench_mimo_bwd_bwd.md "$OUT"/bench_mimo_combined.md
    run_phase bench-mimo "$OUT/bench_mimo.log" "$MB_LIMIT" \
      env PYTHONPATH="$MB_PYTHONPATH" "$PY" "$ROOT/bench/bench_mimo_bwd.py" "${MB_ARGS[@]}"
    # One table per op (bwd_fwd, bwd_bwd, combined): the agreement tables first, then the
    # performance tables (from the line "Device ..." on), so that those come last.
    MB_AGREE="" MB_PERF=""
    for f in bench_mimo_bwd bench_mimo_bwd_bwd bench_mimo_combined; do
      [ -f "$OUT/$f.md" ] || continue
      hdr=$(head -n 1 "$OUT/$f.md")
      agree=$(awk '/^Device /{exit} NR > 1' "$OUT/$f.md" | sed '/./,$!d')
      [ -n "$agree" ] && MB_AGREE+="${MB_AGREE:+$'\n\n'}$hdr (agreement)"$'\n\n'"$agree"
      MB_PERF+="${MB_PERF:+$'\n\n'}$hdr"$'\n\n'"$(awk '/^Device /{p=1} p' "$OUT/$f.md")"
    done
    MIMO_BENCH_TABLE="$MB_AGREE${MB_AGREE:+$'\n\n'}$MB_PERF"
  else
    skip_phase bench-mimo "no library"
  fi
fi

# ------------------------------------------------------------------ K3 probe
# bench/k3_fused_probe.cu (a few seconds): today's K3 product form against the fused one, with
# the benchmark phases (it is a measurement, not a test).
PROBE_TABLE=""
if [ "$DO_BENCH" = 1 ] || [ "$DO_BENCH_MIMO" = 1 ]; then
  if [ -x "$BUILD_DIR/mamba3-k3-probe" ]; then
    # (Its table is shown when the bits differ too: the exit status says so.)
    run_phase k3-probe "$OUT/k3_probe.log" 60 "$BUILD_DIR/mamba3-k3-probe"
    PROBE_TABLE=$(grep -E '^(device|\||outputs)' "$OUT/k3_probe.log")
  else
    skip_phase k3-probe "mamba3-k3-probe not built"
  fi
fi

# ------------------------------------------------------------------ summary
{
  echo
  echo "## gpu_check summary ($(( $(date +%s) - START ))s, logs in $OUT)"
  echo
  echo "| phase | result | time | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
  for g in gtest_cuda ctest; do
    if [ -f "$OUT/$g.log" ]; then
      echo
      echo "$g: $(grep -E '^\[  (PASSED|FAILED) |tests passed|tests failed' "$OUT/$g.log" | tr '\n' ' ')"
    fi
  done
  if [ -f "$OUT/pytest.log" ]; then
    echo
    echo "pytest: $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -1)"
  fi
  if [ -f "$OUT/pytest_mimo.log" ]; then
    echo
    echo "pytest-mimo: $(grep -E '(passed|failed|error)' "$OUT/pytest_mimo.log" | tail -1)"
  fi
  if [ -n "$BENCH_TABLE" ]; then
    echo
    echo "$BENCH_TABLE"
  fi
  if [ -n "$PROBE_TABLE" ]; then
    echo
    echo "K3 probe (bench/k3_fused_probe.cu):"
    echo
    echo "$PROBE_TABLE"
  fi
  if [ -n "$MIMO_BENCH_TABLE" ]; then
    echo
    echo "$MIMO_BENCH_TABLE"
  fi
} | tee "$OUT/summary.md"

# The device tool returns at most 8 files from $OUT: the tables stay as they are, every log,
# XML and JSON goes into one archive.
(
  cd "$OUT" || exit 0
  pack=()
  for f in *; do
    [ -f "$f" ] || continue
    case "$f" in
      summary.md|selfcheck.md|bench_siso_bwd.md|bench_mimo_bwd.md|bench_mimo_bwd_bwd.md|\
      bench_mimo_combined.md|logs.tar.gz) ;;
      *) pack+=("$f") ;;
    esac
  done
  [ "${#pack[@]}" -gt 0 ] && tar czf logs.tar.gz "${pack[@]}" && rm -f "${pack[@]}"
)
exit "$FAILED"
