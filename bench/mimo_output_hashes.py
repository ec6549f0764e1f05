"""SHA-256 of every output of our mamba3_mimo_bwd_bwd and mamba3_mimo_bwd_combined at the
benchmark's shapes (fixed inputs), for one library (MAMBA3_LIBRARY). Builds meant to keep the
arithmetic print the same lines: run it once per build and compare.

  PYTHONPATH=python MAMBA3_LIBRARY=build/libmamba3.so python bench/mimo_output_hashes.py TAG \
      [--shapes 1,3,4,9] [--ops bwd_bwd,combined]

One line per (op, shape): "HASH op N.. P.. R.. C.. digest TAG". Shapes index
bench_mimo_bwd.SHAPES; each shape's inputs come from a seed of its own (4321 + index).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_mimo_bwd as bm  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--shapes", default=",".join(str(i) for i in range(len(bm.SHAPES))))
    ap.add_argument("--ops", default="bwd_bwd,combined")
    args = ap.parse_args()
    ops = args.ops.split(",")
    for si in (int(x) for x in args.shapes.split(",")):
        shape = bm.SHAPES[si]
        C = shape[3]
        s = bm.make_inputs(shape, seed=4321 + si)
        bm.bb_prepare(s, shape)
        runs = {"bwd_bwd": lambda: bm.bb_ours(s, C), "combined": lambda: bm.cb_ours(s, C)}
        for op in ops:
            outs = runs[op]()
            torch.cuda.synchronize()
            h = hashlib.sha256()
            for o in outs:
                if o is not None and o.numel():
                    h.update(o.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
            print(f"HASH {op} {bm.label(shape)} {h.hexdigest()[:16]} {args.tag}", flush=True)


if __name__ == "__main__":
    main()
