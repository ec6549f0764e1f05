"""Host time per call of the SISO front end, compiled binding (mamba3_kernels._C) against ctypes.

    PYTHONPATH=python python bench/bench_host_siso.py [--device cuda|cpu] [--shape B,S,G,H,N,A]

Times the public entry points (siso.compute_dqktheta, siso.compute_ddt_dtrap_dinput_states with
and without states) through each binding in one process: "compiled" calls the public function
(which uses _C when it is loaded), "ctypes" calls the ctypes implementation the public function
falls back to. On CUDA a burst of `--burst` calls is enqueued and only the enqueueing is timed
(synchronised before and after each burst, so the GPU queue never fills); on CPU the time includes
the (small) computation. Reports the best of `--repeat` bursts, in microseconds per call.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
import siso_ref as R  # noqa: E402

import mamba3_kernels  # noqa: E402
from mamba3_kernels import siso  # noqa: E402


def per_call_us(fn, device, burst, repeat):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        t1 = time.perf_counter()
        sync()
        best = min(best, (t1 - t0) / burst)
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="1,64,4,4,16,8", help="B,S,G,H,N,A (default %(default)s)")
    ap.add_argument("--burst", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=40)
    cfg = ap.parse_args()
    B, S, G, H, N, A = (int(x) for x in cfg.shape.split(","))
    dev = cfg.device
    torch.set_num_threads(1)
    inp = R.make_dqktheta_inputs(B, S, G, H, N, A, torch.bfloat16, dok=True, device=dev)
    dqk = R.dqk_args(inp)
    d = R.make_ddt_inputs(B, H, S, torch.float32, P=16, N=N, device=dev)
    ddt4 = (d["dscale"], d["dgamma"], d["dt"], d["trap"])
    ddt7 = R.ddt_args(d)
    compiled = mamba3_kernels.binding() == "compiled"
    print(f"torch {torch.__version__}; device {dev}; library {mamba3_kernels.library_path()}; "
          f"binding {mamba3_kernels.binding()}; shape B,S,G,H,N,A = {cfg.shape}")
    rows = [
        ("compute_dqktheta",
         lambda: siso.compute_dqktheta(*dqk),
         lambda: siso._dqktheta_functional_ctypes(*dqk, 64, None)),
        ("compute_ddt_dtrap_dinput_states",
         lambda: siso.compute_ddt_dtrap_dinput_states(*ddt4),
         lambda: siso._ddt_functional_ctypes(*ddt4, None, None, None, None)),
        ("compute_ddt_dtrap_dinput_states (states)",
         lambda: siso.compute_ddt_dtrap_dinput_states(*ddt7),
         lambda: siso._ddt_functional_ctypes(*ddt7, None)),
    ]
    print("| op | compiled us/call | ctypes us/call |\n|---|---|---|")
    for name, fc, ft in rows:
        c = f"{per_call_us(fc, dev, cfg.burst, cfg.repeat):.1f}" if compiled else "n/a"
        t = per_call_us(ft, dev, cfg.burst, cfg.repeat)
        print(f"| {name} | {c} | {t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
