#!/usr/bin/env python3
"""Per-source-line totals of one kernel in an Nsight Compute report, without Nsight Compute:
stall samples (all, long / short scoreboard, barrier, wait), executed warp instructions and
excess shared-memory wavefronts (bank conflicts), per chunk when given the chunk count.

  python3 bench/ncu_by_line.py REPORT.ncu-rep [--chunks N] [--top 40] [--result N] [--intervals]

--intervals: instead, the same totals per barrier interval (the SASS split after each BAR.SYNC
in address order: a barrier's own wait, sampled at the instruction after it, counts in the
interval it opens), with each interval's line range in the source file most of its
instructions come from (inlined helpers widen it): where a chunk loop's phases spend their
samples and instructions.

The per-instruction counters and each instruction's source line come from
bench/ncu_source_counters.py's extract() (the line table of the cubin embedded in the report:
`nvdisasm -g`; the library is built with -lineinfo). Lines are those of the source the report's
library was built from.
"""

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ncu_source_counters as ncs  # noqa: E402

COLS = {
    "samples": "smsp__pcsamp_sample_count",
    "inst": "inst_executed",
    "shared excess": "derived__memory_l1_wavefronts_shared_excessive",
    "long sb": "smsp__pcsamp_warps_issue_stalled_long_scoreboard",
    "short sb": "smsp__pcsamp_warps_issue_stalled_short_scoreboard",
    "barrier": "smsp__pcsamp_warps_issue_stalled_barrier",
    "wait": "smsp__pcsamp_warps_issue_stalled_wait",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report")
    ap.add_argument("--chunks", type=float, default=1.0, help="divide counts by this")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--result", type=int, default=0, help="index of the profiled launch")
    ap.add_argument("--nvdisasm", default=None)
    ap.add_argument("--intervals", action="store_true", help="totals per barrier interval")
    a = ap.parse_args()
    x = ncs.extract(a.report, a.result, a.nvdisasm)
    per, line_of = x["per"], x["line_of"]
    if a.intervals:
        intervals(x, a.chunks)
        return
    agg = collections.defaultdict(collections.Counter)
    tot = collections.Counter()
    for pc, _, _, _ in x["rows"]:
        key = line_of.get(pc, ("?", 0))
        for k, m in COLS.items():
            v = float(per.get(m, {}).get(pc) or 0)
            agg[key][k] += v
            tot[k] += v
    print(
        f"kernel {x['demangled']}; per chunk (/{a.chunks:g}): "
        + ", ".join(f"{k} {tot[k] / a.chunks:.0f}" for k in ("inst", "shared excess"))
    )
    print(
        "| file:line | samples % | inst | shared excess | long sb % | short sb % | barrier % "
        "| wait % |"
    )
    print("|---|---|---|---|---|---|---|---|")
    s = tot["samples"] or 1.0
    for key, v in sorted(agg.items(), key=lambda kv: -kv[1]["samples"])[: a.top]:
        print(
            f"| {key[0]}:{key[1]} | {100 * v['samples'] / s:.1f} | {v['inst'] / a.chunks:.0f} | "
            f"{v['shared excess'] / a.chunks:.0f} | {100 * v['long sb'] / s:.1f} | "
            f"{100 * v['short sb'] / s:.1f} | {100 * v['barrier'] / s:.1f} | "
            f"{100 * v['wait'] / s:.1f} |"
        )


def intervals(x, chunks):
    per, line_of = x["per"], x["line_of"]
    rows = sorted(x["rows"], key=lambda r: r[0])
    val = lambda m, pc: float(per.get(m, {}).get(pc) or 0)  # noqa: E731
    parts, cur = [], []
    for r in rows:
        cur.append(r)
        if "BAR.SYNC" in r[1]:
            parts.append(cur)
            cur = []
    if cur:
        parts.append(cur)
    tot = sum(val(COLS["samples"], r[0]) for r in rows) or 1.0
    print(f"kernel {x['demangled']}; {len(parts)} intervals (split after each BAR.SYNC)")
    print(f"| # | source lines (main file: min-max) | samples % | inst (/{chunks:g}) | long sb % "
          "| short sb % | barrier % | wait % |")
    print("|---|---|---|---|---|---|---|---|")
    for i, part in enumerate(parts):
        c = collections.Counter()
        for r in part:
            for k, m in COLS.items():
                c[k] += val(m, r[0])
        # The line range, in the file most of the interval's instructions come from.
        lines = [line_of.get(r[0]) for r in part if line_of.get(r[0])]
        span = "?"
        if lines:
            f = collections.Counter(fl for fl, _ in lines).most_common(1)[0][0]
            ln = [n for fl, n in lines if fl == f]
            span = f"{f}:{min(ln)}-{max(ln)}"
        print(f"| {i} | {span} | {100 * c['samples'] / tot:.1f} | {c['inst'] / chunks:.0f} | "
              f"{100 * c['long sb'] / tot:.1f} | {100 * c['short sb'] / tot:.1f} | "
              f"{100 * c['barrier'] / tot:.1f} | {100 * c['wait'] / tot:.1f} |")


if __name__ == "__main__":
    main()
