#!/usr/bin/env bash
# Builds libmamba3.so at several revisions for scripts/device_ab.sh, in one scratch worktree and
# one build directory, so that each revision after the first recompiles only the files it
# changes (a candidate that edits one kernel file: ~30 s here, against ~8 min for the first).
#
#   scripts/build_ab_libs.sh DIR TAG=REV [TAG=REV ...]
#
# Writes DIR/lib<TAG>.so.xz per revision (sm_90a only: -DMAMBA3_CUDA_PTX=OFF, ~13 MB each), and
# DIR/mamba3_tests.xz and DIR/mamba3-selfcheck.xz built at the first revision. DIR is created;
# keep it git-ignored (e.g. .devab1/, with .dev*/ in .git/info/exclude), then carry it:
#   run(command="OUT=$OUT BASE=<first TAG> OPS=... scripts/device_ab.sh DIR", carry=["DIR"])
# Environment: AB_WORKTREE (default /tmp/mamba3-ab-worktree), JOBS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 DIR TAG=REV [TAG=REV ...]" >&2; exit 2; }
DIR=$1; shift
mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
WT=${AB_WORKTREE:-/tmp/mamba3-ab-worktree}
JOBS=${JOBS:-$(nproc)}
for spec in "$@"; do
  case $spec in *=*) ;; *) echo "not TAG=REV: $spec" >&2; exit 2 ;; esac
  git rev-parse --verify -q "${spec#*=}^{commit}" >/dev/null ||
    { echo "no such revision: $spec" >&2; exit 2; }
done
if [ ! -d "$WT" ]; then
  git worktree add -q --detach "$WT" HEAD
fi
first=1
for spec in "$@"; do
  tag=${spec%%=*}; rev=$(git rev-parse "${spec#*=}")
  git -C "$WT" checkout -q --detach "$rev"
  if [ ! -f "$WT/build_ab/build.ninja" ]; then
    cmake -S "$WT" -B "$WT/build_ab" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMAMBA3_CUDA_PTX=OFF \
      > /dev/null
  fi
  t0=$(date +%s)
  targets=libmamba3.so
  [ $first = 1 ] && targets="libmamba3.so mamba3_tests mamba3-selfcheck"
  # shellcheck disable=SC2086
  ninja -C "$WT/build_ab" -j "$JOBS" $targets > "$DIR/build_$tag.log"
  xz -T0 -6 -c "$WT/build_ab/libmamba3.so" > "$DIR/lib$tag.so.xz"
  if [ $first = 1 ]; then
    xz -T0 -6 -c "$WT/build_ab/mamba3_tests" > "$DIR/mamba3_tests.xz"
    xz -T0 -6 -c "$WT/build_ab/mamba3-selfcheck" > "$DIR/mamba3-selfcheck.xz"
  fi
  echo "$tag = $(git log --oneline -1 "$rev" | cut -c1-70): $(( $(date +%s) - t0 )) s"
  first=0
done
du -sh "$DIR"
