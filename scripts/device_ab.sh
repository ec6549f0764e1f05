#!/usr/bin/env bash
# A/B of several builds of libmamba3.so on one GPU, in one call: per-kernel times of the MIMO ops
# in alternating rounds, output hashes, and the CUDA tests and self-check of each candidate.
#
#   scripts/device_ab.sh DIR
#
# DIR (git-ignored; carried to the device) holds lib<TAG>.so or lib<TAG>.so.xz per build, and
# optionally mamba3_tests[.xz] and mamba3-selfcheck[.xz] built here (they load libmamba3.so from
# LD_LIBRARY_PATH: each candidate in turn). The base build's tag is BASE (default F, e.g. main);
# the others are the candidates. Environment:
#   TAGS=F,X,Y       order of the builds in each round (default: BASE first, then the others found)
#   OPS=bwd_bwd      kernel_times.py ops;  SHAPES=0,...,10  its shape indices;  CALLS=5
#   ROUNDS=2         rounds, each running every build once (alternating: noise spreads evenly)
#   HASH_SHAPES=1,3,4,9   bench/mimo_output_hashes.py shapes ("" skips the hashes)
#   TESTS=1          gtests ('*Cuda*') and the CUDA self-check of each candidate (0: none)
#   TEST_TAGS=X,Y    only these candidates' tests (default: every candidate)
#   PYTEST="FILES"   with TESTS=1, also these pytest files against each candidate's library
#                    (e.g. tests/python/test_mimo_bwd_combined_cuda.py); none by default
#   SANITIZE=FILTER  with TESTS=1, also compute-sanitizer's memcheck, racecheck and synccheck on
#                    the gtests FILTER selects (e.g. '*NormDd*'), per candidate; none by default
#   MATCH=chunk_planes    kernel name summed separately in the summary (e.g. the K3)
# Results under $OUT (default ./ab_out): kt_<op>.jsonl, hashes.txt, gtest_<tag>.log,
# selfcheck_<tag>.md, pytest_<tag>.log, sanitize_<tool>_<tag>.log, summary_<op>.txt; the
# summary of the first op is printed last.
# Compare builds only within one call: machines differ by several per cent.
set -uo pipefail  # (no -e: one failed run must not stop the others)
cd "$(dirname "$0")/.." || exit 1
[ $# -eq 1 ] && [ -d "$1" ] || { echo "usage: $0 DIR (with lib<TAG>.so[.xz] files)" >&2; exit 2; }
SRC=$(cd "$1" && pwd)
OUT=${OUT:-$PWD/ab_out}; mkdir -p "$OUT"
BASE=${BASE:-F}; OPS=${OPS:-bwd_bwd}; SHAPES=${SHAPES:-0,1,2,3,4,5,6,7,8,9,10}; CALLS=${CALLS:-5}
ROUNDS=${ROUNDS:-2}; HASH_SHAPES=${HASH_SHAPES-1,3,4,9}; TESTS=${TESTS:-1}
MATCH=${MATCH:-chunk_planes}
W=$(mktemp -d)
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null

# Unpack what DIR holds into W (xz or plain).
unpack() {  # name -> W/name, or nothing if absent
  if [ -f "$SRC/$1.xz" ]; then
    xz -T0 -dc "$SRC/$1.xz" > "$W/$1"
  elif [ -f "$SRC/$1" ]; then
    cp "$SRC/$1" "$W/$1"
  fi
}
found=$(ls "$SRC" | sed -n 's/^lib\(.*\)\.so\(\.xz\)\{0,1\}$/\1/p' | grep -v '^mamba3$' | sort -u)
if [ -n "${TAGS:-}" ]; then tags=${TAGS//,/ }; else
  tags="$(echo "$found" | grep -x "$BASE") $(echo "$found" | grep -vx "$BASE" | tr '\n' ' ')"
fi
for t in $tags; do
  unpack "lib$t.so"
  [ -f "$W/lib$t.so" ] || { echo "no lib$t.so(.xz) in $SRC" >&2; exit 2; }
done
unpack mamba3_tests; unpack mamba3-selfcheck; chmod +x "$W"/mamba3* 2>/dev/null
echo "builds: $tags ($(el) s)"

for op in ${OPS//,/ }; do
  for r in $(seq 1 "$ROUNDS"); do
    for t in $tags; do
      PYTHONPATH=python MAMBA3_LIBRARY="$W/lib$t.so" timeout 200 python3 bench/kernel_times.py \
        --tag "$t" --ops "$op" --shapes "$SHAPES" --calls "$CALLS" --json "$OUT/kt_$op.jsonl" \
        > /dev/null 2>&1 || echo "kernel_times $t $op failed"
    done
    echo "$op round $r ($(el) s)"
  done
  python3 bench/kernel_times_summary.py "$OUT/kt_$op.jsonl" --base "$BASE" --match "$MATCH" \
    > "$OUT/summary_$op.txt"
done

if [ -n "$HASH_SHAPES" ]; then
  for t in $tags; do
    PYTHONPATH=python MAMBA3_LIBRARY="$W/lib$t.so" timeout 120 python3 bench/mimo_output_hashes.py \
      "$t" --shapes "$HASH_SHAPES" >> "$OUT/hashes.txt" 2>&1 || echo "hashes $t failed"
  done
  # Per candidate: how many (op, shape) lines differ from the base's.
  for t in $tags; do
    [ "$t" = "$BASE" ] && continue
    d=$(awk -v b="$BASE" -v c="$t" '
          $1 == "HASH" { k = $2" "$3" "$4" "$5" "$6
                         if ($8 == b) B[k] = $7; if ($8 == c) C[k] = $7 }
          END { n = 0; m = 0; for (k in C) { m++; if (!(k in B) || B[k] != C[k]) n++ }
                print n " of " m }' "$OUT/hashes.txt")
    echo "hashes $t: $d lines differ from $BASE"
  done
fi

if [ "$TESTS" = 1 ]; then
  ttags=${TEST_TAGS:-$tags}
  for t in ${ttags//,/ }; do
    [ "$t" = "$BASE" ] && continue
    cp "$W/lib$t.so" "$W/libmamba3.so"
    if [ -x "$W/mamba3_tests" ]; then
      t1=$(date +%s)
      LD_LIBRARY_PATH="$W" timeout 150 "$W/mamba3_tests" --gtest_filter='*Cuda*' \
        > "$OUT/gtest_$t.log" 2>&1
      rc=$?
      res=$(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/gtest_$t.log" | head -2 | tr '\n' ' ')
      echo "gtests $t rc $rc ($(( $(date +%s) - t1 )) s): $res"
    fi
    if [ -x "$W/mamba3-selfcheck" ]; then
      sc="$OUT/selfcheck_$t.md"
      LD_LIBRARY_PATH="$W" timeout 90 "$W/mamba3-selfcheck" --device cuda --output "$sc" \
        > /dev/null 2>&1
      echo "selfcheck $t rc $?: PASS $(grep -c PASS "$sc") FAIL $(grep -c FAIL "$sc")"
    fi
    if [ -n "${SANITIZE:-}" ] && [ -x "$W/mamba3_tests" ]; then
      san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      for tool in memcheck racecheck synccheck; do
        t1=$(date +%s)
        LD_LIBRARY_PATH="$W" timeout 300 "$san" --tool "$tool" --error-exitcode 9 \
          "$W/mamba3_tests" --gtest_filter="$SANITIZE" > "$OUT/sanitize_${tool}_$t.log" 2>&1
        rc=$?
        echo "$tool $t rc $rc ($(( $(date +%s) - t1 )) s):" \
             "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_${tool}_$t.log" | tail -1)"
      done
    fi
    if [ -n "${PYTEST:-}" ]; then
      t1=$(date +%s)
      # shellcheck disable=SC2086
      PYTHONPATH=python MAMBA3_LIBRARY="$W/lib$t.so" timeout 300 python3 -m pytest $PYTEST -q \
        -rfE -p no:cacheprovider > "$OUT/pytest_$t.log" 2>&1
      rc=$?
      echo "pytest $t rc $rc ($(( $(date +%s) - t1 )) s): $(tail -1 "$OUT/pytest_$t.log")"
    fi
  done
fi
rm -rf "$W"
echo "total $(el) s"
cat "$OUT/summary_${OPS%%,*}.txt"
