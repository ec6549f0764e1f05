#!/usr/bin/env bash
# Extracts the upstream mamba_ssm files our benchmarks import (bench/bench_siso_bwd.py and
# bench/bench_mimo_bwd.py) from a git clone or mirror of state-spaces/mamba into the git-ignored
# folder .upstream/ (added to .git/info/exclude here), with the empty package files Python needs.
# Never committed: upstream's code is not ours to ship (DEVELOPERS.md).
#
#   scripts/extract_upstream.sh GIT_DIR [COMMIT]     (COMMIT default HEAD; the benchmarks were
#                                                     measured against e9594ce)
#
# Only the five modules the comparisons import (~280 KB): all of upstream's mamba3 folders
# (~580 KB) put a device call's carry over its 64 MiB limit beside a packed build (session 41).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
SRC=$1 REV=${2:-HEAD}
FILES=(
  mamba_ssm/ops/tilelang/mamba3/mamba3_mimo_bwd.py         # mamba_mimo_bwd_bwd / _combined
  mamba_ssm/ops/triton/mamba3/mamba3_siso_bwd.py           # compute_dqktheta, compute_ddt_...
  mamba_ssm/ops/triton/mamba3/mamba3_mimo_utils.py         # imported by mamba3_mimo_bwd.py
  mamba_ssm/ops/triton/mamba3/grouped_head_reduction.py    # imported by mamba3_mimo_bwd.py
  mamba_ssm/ops/triton/mamba3/utils.py                     # imported by mamba3_siso_bwd.py
)
grep -qx '.upstream/' .git/info/exclude 2>/dev/null || echo '.upstream/' >> .git/info/exclude
rm -rf .upstream
mkdir -p .upstream
git --git-dir="$SRC" archive "$REV" "${FILES[@]}" | tar -x -C .upstream
for d in mamba_ssm mamba_ssm/ops mamba_ssm/ops/triton mamba_ssm/ops/triton/mamba3 \
         mamba_ssm/ops/tilelang mamba_ssm/ops/tilelang/mamba3; do
  : > ".upstream/$d/__init__.py"
done
echo "extracted $(git --git-dir="$SRC" rev-parse --short "$REV") into .upstream" \
     "($(du -sk .upstream | cut -f1) KiB)"
