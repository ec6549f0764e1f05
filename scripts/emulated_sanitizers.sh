#!/usr/bin/env bash
# The CUDA kernel bodies under the host CTA emulator (tests/cpp/*_emulated.cpp), built again with
# ThreadSanitizer and with AddressSanitizer + UndefinedBehaviorSanitizer, and run. Needs no GPU.
#
# Why: the emulator runs each CTA's threads as std::threads with mutex / condition-variable
# barriers for mb_sync and the warp collectives, and the kernels' shared memory is host memory.
# So ThreadSanitizer sees every shared-memory access the bodies make between two barriers: a
# missing mb_sync is a data race it reports (the host twin of compute-sanitizer's racecheck,
# run where no GPU is). ASan reports reads and writes outside the host buffers that stand for
# global and shared memory (memcheck's twin for these bodies), UBSan signed overflow, e.g. of the
# 32-bit offsets of the compile-time-layout kernels. What it cannot see: anything the emulator
# does not model (the real warp's lockstep, cp.async / TMA, the device's own code generation);
# compute-sanitizer on the H200 stays the check for those.
#
#   scripts/emulated_sanitizers.sh [tsan|asan|both] [gtest filter]
#     BUILD_DIR (default build): a configured CUDA build whose libmamba3.so and
#       libmamba3_golden.a the sanitised test objects link against (build_and_test.sh makes it).
#     Default filter: every emulated suite except the long bits-identity cases (listed in
#       SLOW below; they run the same bodies at more shapes): a few minutes on 2 cores.
# Each sanitizer first runs tests/sanitizer/planted_faults.cpp: its planted fault must be
# reported and its clean twin must not be. Exits non-zero when a probe, a test or a sanitizer
# report fails.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
B=$(cd "$BUILD_DIR" && pwd)
MODE=${1:-both}
SLOW='*SpecialisedGivesIdenticalBits:*ContiguousLayoutGivesIdenticalBits:*CombinedLayoutGivesIdenticalBits:*ContiguousLayoutKernelsGiveIdenticalBits'
FILTER=${2:-"*Emulated.*-$SLOW"}
REPORT='WARNING: ThreadSanitizer|ERROR: AddressSanitizer|runtime error:'  # a sanitizer's report
case "$MODE" in tsan | asan | both) ;; *) echo "mode: tsan, asan or both" >&2; exit 2 ;; esac
[ -f "$B/libmamba3.so" ] && [ -f "$B/libmamba3_golden.a" ] || {
  echo "no $B/libmamba3.so / libmamba3_golden.a: run scripts/build_and_test.sh first" >&2; exit 2; }
grep -q "MAMBA3_CUDA:BOOL=ON" "$B/CMakeCache.txt" 2>/dev/null || {
  echo "$B is not a CUDA build (the emulated tests need the CUDA headers and MAMBA3_CUDA=ON)" >&2; exit 2; }
CUDA_INC=$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/../include
SRCS=(tests/cpp/cta_emulator.cpp tests/cpp/*_emulated.cpp)
INC=(-DMAMBA3_GOLDEN_CUDA -DMAMBA3_WITH_CUDA -Isrc -Itests/cpp -Iinclude -Ithird_party/dlpack/include
     -Igolden/include -isystem "$CUDA_INC" -DGTEST_HAS_PTHREAD=1 -std=gnu++17 -O1 -g)
LIBS=(-Wl,-rpath,"$B" "$B/libmamba3.so" "$B/libmamba3_golden.a" -lgtest -lgtest_main -ldl -lpthread)
for d in "$CUDA_INC/../lib64" "$CUDA_INC/../lib" /usr/local/cuda/lib64 /usr/local/cuda/lib; do
  if [ -f "$d/libcudart_static.a" ]; then LIBS+=("$d/libcudart_static.a" -lrt); break; fi
done

# run NAME FLAGS ENV: build the objects (one directory per sanitizer) and run the filter.
run() {
  local name=$1 flags=$2 envs=$3 dir="$B/emu_$1"
  mkdir -p "$dir"
  echo "== $name: building ${#SRCS[@]} sources ($flags)"
  local objs=()
  for s in "${SRCS[@]}"; do
    local o="$dir/$(basename "$s" .cpp).o"
    g++ "${INC[@]}" $flags -c "$s" -o "$o"  # always (about a minute in all at -O1)
    objs+=("$o")
  done
  g++ $flags -o "$dir/emu_tests" "${objs[@]}" "${LIBS[@]}"
  # The probes first (tests/sanitizer/planted_faults.cpp): the planted fault must be reported,
  # the clean twin must not be.
  local probe=tests/sanitizer/planted_faults.cpp plant want
  if [ "$name" = tsan ]; then plant=PLANT_RACE; want="WARNING: ThreadSanitizer: data race"; else
    plant=PLANT_OOB; want="ERROR: AddressSanitizer"; fi
  g++ "${INC[@]}" $flags -D$plant "$probe" "$dir/cta_emulator.o" -o "$dir/probe_fault" -lpthread
  g++ "${INC[@]}" $flags -DWITH_SYNC "$probe" "$dir/cta_emulator.o" -o "$dir/probe_clean" -lpthread
  env $envs "$dir/probe_fault" > "$dir/probe_fault.log" 2>&1 || true  # (it exits non-zero)
  env $envs "$dir/probe_clean" > "$dir/probe_clean.log" 2>&1 || true
  if ! grep -q "$want" "$dir/probe_fault.log"; then
    echo "== $name: the planted fault ($plant) was NOT reported: this sanitizer run proves nothing" >&2
    return 1
  fi
  if grep -q -E "$REPORT" "$dir/probe_clean.log"; then
    echo "== $name: the clean probe was reported ($dir/probe_clean.log)" >&2
    return 1
  fi
  echo "== $name: probes ok (the planted $plant is reported, its clean twin is not)"
  echo "== $name: running '$FILTER'"
  local log="$dir/run.log" t0=$SECONDS rc=0
  env $envs "$dir/emu_tests" --gtest_filter="$FILTER" > "$log" 2>&1 || rc=$?
  local reports
  reports=$(grep -c -E "$REPORT" "$log" || true)
  echo "== $name: $(grep -E '^\[  (PASSED|FAILED)' "$log" | tr '\n' ' ')rc=$rc, sanitizer reports: $reports ($((SECONDS - t0)) s; log $log)"
  if [ "$rc" != 0 ] || [ "$reports" != 0 ]; then
    grep -E -A14 "$REPORT|^\[  FAILED" "$log" | head -60
    return 1
  fi
}

status=0
if [ "$MODE" != asan ]; then
  run tsan "-fsanitize=thread" "TSAN_OPTIONS=halt_on_error=0:history_size=2" || status=1
fi
if [ "$MODE" != tsan ]; then
  run asan "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
    "ASAN_OPTIONS=detect_leaks=0" || status=1
fi
exit $status
