"""Summary of kernel_times.py JSON lines from an A/B run (several libraries, alternating rounds):
per shape, the minimum over rounds of each library's sum of kernel times (and of the state
kernels: K1 + K2 or the chain), then each library's geometric mean over the shapes against a
base library.

  python bench/kernel_times_summary.py kt.jsonl [--base F] [--match chunk_planes]

--match NAME also prints the minimum of the kernels whose name contains NAME (e.g. the K3 alone).
The last line is "BEST tag": the library with the lowest geometric mean, the base included (a
candidate slower than the base is not called best).
"""
from __future__ import annotations

import argparse
import collections
import json
import math


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--base", default="F")
    ap.add_argument("--match", default="")
    args = ap.parse_args()
    state = collections.defaultdict(dict)  # shape -> tag -> [ms]
    total = collections.defaultdict(dict)
    match = collections.defaultdict(dict)
    try:
        lines = open(args.jsonl).readlines()
    except FileNotFoundError:
        print(f"no results: {args.jsonl} does not exist (every kernel_times run failed?)")
        return
    for line in lines:
        r = json.loads(line)
        k = r["kernels"]
        sh, t = r["shape"], r["tag"]
        state[sh].setdefault(t, []).append(sum(
            v for n, v in k.items() if "increment" in n or "bb_scan" in n or "state_chain" in n))
        total[sh].setdefault(t, []).append(sum(k.values()))
        if args.match:
            match[sh].setdefault(t, []).append(sum(v for n, v in k.items() if args.match in n))
    tags = sorted({t for sh in total for t in total[sh]}, key=lambda t: (t != args.base, t))
    head = "ms, min over rounds: state kernels | all kernels"
    print(head + (f" | {args.match}" if args.match else ""))
    for sh in total:
        row = " ".join(f"{t} {min(state[sh][t]):.3f}" for t in tags if t in state[sh])
        row += " | " + " ".join(f"{t} {min(total[sh][t]):.3f}" for t in tags if t in total[sh])
        if args.match:
            row += " | " + " ".join(f"{t} {min(match[sh][t]):.3f}" for t in tags if t in match[sh])
        print(f"  {sh:18s} {row}")
    gm = {}
    for t in tags:
        rs = [min(total[sh][t]) / min(total[sh][args.base])
              for sh in total if t in total[sh] and args.base in total[sh]]
        if rs:
            gm[t] = math.exp(sum(map(math.log, rs)) / len(rs))
            print(f"  {t}/{args.base} kernel-sum geomean {gm[t]:.4f} over {len(rs)} shapes")
    print("BEST", min(gm, key=gm.get) if gm else args.base)


if __name__ == "__main__":
    main()
