#!/usr/bin/env python3
"""Our compute_dqktheta alone, GPU time per call, for an A/B of two builds (one per process).

CUDA events around 30 back-to-back calls after a GPU sleep (no host gaps timed), inputs rotating
among 3 copies, median of 7 trials; the benchmark's shapes (bench_siso_bwd.py) plus B1 / B2.
Usage: MAMBA3_LIBRARY=<lib> python bench/dqktheta_ab.py TAG B4,B8,GQA
Prints "AB TAG SHAPE <median> us (min <min>)" per shape; run the builds alternately.
Each call's outputs are kept alive until the call three later, so that the outputs too rotate
among distinct buffers, as in bench_siso_bwd.py; KEEP=0 lets the caching allocator hand every
call the same output memory (the previous call's lines may still be in L2: those writes then
never reach DRAM; sessions 36-37 measured that way).
"""
import os
import statistics
import sys

sys.path.insert(0, "bench")
sys.path.insert(0, "python")
import torch  # noqa: E402

import bench_siso_bwd as bs  # noqa: E402
from mamba3_kernels import siso  # noqa: E402

SHAPES = {"B4": (4, 2048, 32, 1, 128, 32), "B8": (8, 4096, 32, 1, 128, 32),
          "GQA": (2, 2048, 16, 4, 64, 16), "B1": (1, 2048, 32, 1, 128, 32),
          "B2": (2, 2048, 32, 1, 128, 32)}


def main():
    tag, names = sys.argv[1], sys.argv[2].split(",")
    for name in names:
        sets = [bs.dqktheta_inputs(*SHAPES[name], seed) for seed in range(3)]
        f = lambda s: siso.compute_dqktheta(*(s[k] for k in bs.DQK_ORDER))  # noqa: E731
        if os.environ.get("KEEP") != "0":
            f = bs.keeping_outputs(f, len(sets))
        for i in range(5):
            f(sets[i % 3])
        torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(20_000_000)
            e0.record()
            for i in range(30):
                f(sets[i % 3])
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 30 * 1e3)
        print(f"AB {tag} {name} {statistics.median(ts):.2f} us (min {min(ts):.2f})", flush=True)


if __name__ == "__main__":
    main()
