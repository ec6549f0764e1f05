#!/usr/bin/env python3
"""SHA-256 of compute_dqktheta's outputs on fixed inputs, for bitwise A/B of two builds.

Run once per build (MAMBA3_LIBRARY=<path to libmamba3.so>) and diff the printed lines: a change
that must keep the bits (index math, instruction counts) prints the same hashes. The cases are
the benchmark shapes (B4, B8, GQA) and small shapes that take the split-run kernel's other paths
(batch-row ends inside a block, partial last blocks, d_ok_state, varlen, N = 32 / 64 / 256, both
16-bit dtypes). Needs a CUDA device. Usage: python bench/hash_dqktheta.py [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    from mamba3_kernels import siso
except ImportError:  # running from a source checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(REPO, "python"))
    from mamba3_kernels import siso

DEV = "cuda"
OUT = ("dq", "dk", "dq_bias", "dk_bias", "dangles", "dscale", "dgamma")


def inputs(B, S, H, G, N, A, dt, seed, dok=False, seqlens=None):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(shape, dtype, s=1.0):
        return (torch.randn(shape, generator=g, device=DEV) * s).to(dtype)

    def rand(shape, lo, hi):
        return torch.rand(shape, generator=g, device=DEV) * (hi - lo) + lo

    d = dict(q=randn((B, S, G, N), dt), k=randn((B, S, G, N), dt),
             scale=rand((B, H, S), 0.05, 0.55), gamma=rand((B, H, S), 0.05, 0.55),
             q_bias=randn((H, N), dt, 0.5), k_bias=randn((H, N), dt, 0.5),
             angles=rand((B, S, H, A), 0.0, 2 * math.pi),
             dq_in=randn((B, S, H, N), dt), dk_in=randn((B, S, H, N), dt),
             dqk=randn((B, H, S), torch.float32))
    nseq = len(seqlens) if seqlens else B
    d["d_ok_state"] = randn((nseq, H, N), torch.float32) if dok else None
    d["cu_seqlens"] = None
    if seqlens:
        cu = [0]
        for n in seqlens:
            cu.append(cu[-1] + n)
        d["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEV)
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the B8 shape")
    cfg = ap.parse_args()
    bf, f16 = torch.bfloat16, torch.float16
    # name, B, S, H, G, N, A, dtype, seed, d_ok_state, seqlens
    cases = [
        ("B4", 4, 2048, 32, 1, 128, 32, bf, 1, False, None),
        ("B8", 8, 4096, 32, 1, 128, 32, bf, 2, False, None),
        ("GQA", 2, 2048, 16, 4, 64, 16, bf, 3, False, None),
        ("B4 dok", 4, 2048, 32, 1, 128, 32, bf, 4, True, None),
        ("GQA dok", 2, 2048, 16, 4, 64, 16, bf, 5, True, None),
        ("rows wrap in blocks", 3, 37, 8, 1, 128, 32, bf, 6, True, None),
        ("f16 N64 heads 16", 2, 53, 16, 1, 64, 16, f16, 7, True, None),
        ("N32 whole group", 3, 45, 8, 1, 32, 8, bf, 8, True, None),
        ("N32 f16 whole group", 2, 29, 16, 2, 32, 8, f16, 9, False, None),
        ("N256", 2, 31, 4, 1, 256, 64, bf, 10, True, None),
        ("N256 whole group", 3, 23, 1, 1, 256, 64, f16, 11, True, None),
        ("varlen", 1, 700, 16, 2, 64, 16, bf, 12, True, [1, 2, 300, 5, 1, 391]),
        ("varlen N128", 1, 999, 32, 1, 128, 32, bf, 13, True, [500, 1, 498]),
    ]
    for name, B, S, H, G, N, A, dt, seed, dok, seqlens in cases:
        if cfg.quick and name == "B8":
            continue
        d = inputs(B, S, H, G, N, A, dt, seed, dok, seqlens)
        outs = siso.compute_dqktheta(d["q"], d["k"], d["scale"], d["gamma"], d["q_bias"],
                                     d["k_bias"], d["angles"], d["dq_in"], d["dk_in"], d["dqk"],
                                     d["d_ok_state"], cu_seqlens=d["cu_seqlens"])
        torch.cuda.synchronize()
        for o, t in zip(OUT, outs):
            h = hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            print(f"{name:24s} {o:8s} {h.hexdigest()[:32]}")


if __name__ == "__main__":
    main()
