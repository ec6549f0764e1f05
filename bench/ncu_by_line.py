#!/usr/bin/env python3
"""Per-source-line totals of one kernel in an Nsight Compute report, without Nsight Compute:
stall samples (all, long / short scoreboard, barrier, wait), executed warp instructions and
excess shared-memory wavefronts (bank conflicts), per chunk when given the chunk count.

  python3 bench/ncu_by_line.py REPORT.ncu-rep [--chunks N] [--top 40]

The per-instruction counters come from bench/ncu_source_counters.py; the line of each
instruction from the line table of the cubin embedded in the report (`nvdisasm -g`; the library
is built with -lineinfo). Lines are those of the source the report's library was built from.
"""

import argparse
import collections
import csv
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
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
    ap.add_argument("--nvdisasm", default=None)
    a = ap.parse_args()
    tool = ncs.find_tool("nvdisasm", a.nvdisasm)
    if not tool:
        raise SystemExit(
            "nvdisasm not found (NVDISASM=..., PATH, or the nvidia-cuda-nvdisasm wheel)"
        )
    with tempfile.TemporaryDirectory() as td:
        out_csv, cubin = os.path.join(td, "k.csv"), os.path.join(td, "k.cubin")
        subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "ncu_source_counters.py"),
                a.report,
                out_csv,
                "--dump-cubin",
                cubin,
                "--nvdisasm",
                tool,
            ],
            check=True,
            capture_output=True,
        )
        rows = list(csv.DictReader(open(out_csv)))
        dis = subprocess.run([tool, "-g", "-c", cubin], capture_output=True, text=True).stdout
    # The kernel: the function whose code holds the rows' offsets; its name from the report's
    # SASS section headers (the first .text section whose size covers the offsets).
    sections, cur = {}, None
    for line in dis.split("\n"):
        m = re.match(r"^\.text\.(\S+):$", line)
        if m:
            cur = m.group(1)
            sections[cur] = {}
            where = ("?", 0)
            continue
        if cur is None:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if m:
            sections[cur][int(m.group(1), 16)] = where
    srcs = {int(r["Offset"], 0): r["Source"] for r in rows}
    kernel = None
    for name, table in sections.items():
        if len(table) >= len(srcs) and all(o in table for o in list(srcs)[:50]):
            kernel = name
            break
    if kernel is None:
        raise SystemExit("no function of the cubin matches the report's instructions")
    line_of = sections[kernel]
    agg = collections.defaultdict(collections.Counter)
    tot = collections.Counter()
    for r in rows:
        key = line_of.get(int(r["Offset"], 0), ("?", 0))
        for k, c in COLS.items():
            v = float(r.get(c) or 0)
            agg[key][k] += v
            tot[k] += v
    print(
        f"kernel {kernel}; per chunk (/{a.chunks:g}): "
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


if __name__ == "__main__":
    main()
