"""Per-kernel GPU times of our MIMO backward ops (one library per process), for A/B runs of two
builds: run it once per build, alternating (A B A B), and compare the rows.

  PYTHONPATH=python MAMBA3_LIBRARY=build/libmamba3.so \
      python bench/kernel_times.py [--ops bwd_fwd,bwd_bwd,combined,combined_norm] [--shapes 3,0,10]
                                   [--calls 5] [--tag A] [--json FILE]

Shapes index bench_mimo_bwd.SHAPES (B=4 S=2048 H=16 G=1, bf16, Z, D, reduce-O). Each op is
warmed up, then run `--calls` times under torch.profiler; a kernel's time is its total CUDA time
divided by the number of calls, its name shortened to the part before the template arguments.
"op" is the median CUDA-event time of one call (same calls, outside the profiler).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_mimo_bwd as bm  # noqa: E402

def cb_norm_ours(s, C):
    """The combined backward with the fused pre-gate norm (its dD in float64: ndd_* kernels)."""
    if "_norm_weight" not in s:
        H, P = s["v"].shape[2], s["v"].shape[3]
        g = torch.Generator(device="cpu").manual_seed(77)
        s["_norm_weight"] = (0.5 + torch.rand(H, P, generator=g)).to(s["v"].device)
    return bm.mimo.mamba3_mimo_bwd_combined(*(s[k] for k in bm.CB_ARGS), C, bm.RDD,
                                            norm_weight=s["_norm_weight"])


RUNNERS = {
    "bwd_fwd": (None, lambda s, C: bm.ours(s, C)),
    "bwd_bwd": (bm.bb_prepare, lambda s, C: bm.bb_ours(s, C)),
    "combined": (None, lambda s, C: bm.cb_ours(s, C)),
    "combined_norm": (None, cb_norm_ours),
}


def short(name):
    """'void ns::(anonymous namespace)::kern<512, 2>(Args)' -> 'kern<512, 2>'."""
    name = re.sub(r"^void\s+", "", name).replace("(anonymous namespace)::", "")
    name = re.sub(r"\([^()]*\)\s*$", "", name)  # the parameter list
    base = re.sub(r"<.*$", "", name).split("::")[-1]
    targs = re.search(r"<(.*)>", name)
    return f"{base}<{targs.group(1)}>" if targs and len(targs.group(1)) <= 32 else base


def op_ms(fn, calls):
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_ms(fn, calls):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    acc = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        k = short(ev.name)
        acc[k] = acc.get(k, 0.0) + ev.device_time_total / 1000.0
    return {k: v / calls for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="bwd_fwd,bwd_bwd,combined")
    ap.add_argument("--shapes", default="3,0,10")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--tag", default=os.environ.get("MAMBA3_LIBRARY", "?"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for si in (int(x) for x in args.shapes.split(",")):
        shape = bm.SHAPES[si]
        C = shape[3]
        s = bm.make_inputs(shape, seed=1234 + si)
        for op in args.ops.split(","):
            prep, run = RUNNERS[op]
            if prep is not None and "states" not in s:
                prep(s, shape)
            fn = lambda: run(s, C)  # noqa: E731
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            t_op = op_ms(fn, args.calls)
            ks = kernel_ms(fn, args.calls)
            rows.append(dict(tag=args.tag, op=op, shape=bm.label(shape), op_ms=t_op, kernels=ks))
            top = ", ".join(f"{k} {v:.3f}" for k, v in list(ks.items())[:6])
            print(f"{args.tag} | {op} | {bm.label(shape)} | op {t_op:.3f} ms | {top}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
