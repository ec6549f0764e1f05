#!/usr/bin/env python3
"""Benchmark of mamba3_mimo_bwd_fwd (the MIMO backward first pass) against upstream mamba_ssm's
TileLang kernel mamba_mimo_bwd_fwd, in one process on one GPU (SPEC.md section 4).

Shapes: the 11-shape grid B=4, S=2048, H=16, G=1 over (N, P, R, C); bf16 activations (dout, q,
k, v, z) and trap, f32 q/k biases, mimo_v/o/z, D, angles, dt, da_cs, da_cs_rev, segsum (the
dtypes upstream's kernel takes), Z and D on, reduce-O, no norm, rotary divisor 4; states, qk_dot
and dz in bf16 for both implementations.

Measured per shape:
- GPU time: median over trials of (CUDA-event time around `reps` back-to-back calls) / reps,
  each trial behind a GPU sleep long enough for the host to enqueue all calls (device time only;
  bench_siso_bwd.py's method). Inputs rotate among 2 copies. Ours through the Python function
  (it allocates its outputs), upstream's compiled kernel object with preallocated outputs.
- Upstream compile: one kernel per shape, compiled before any timing, in parallel threads (wall
  time per kernel and in total are reported; TileLang's disk cache, TILELANG_CACHE_DIR, makes a
  second run on the same machine skip it). Kernels are kept per shape. A compile that has not
  finished within --compile-timeout seconds is given up (that shape has no upstream column).
- FLOPs (the same count for both): the chunked algorithm's matrix products, with Cr = C*R per
  chunk and head: q k^T scores 2 Cr^2 N, scores x 2 Cr^2 P (dense blocks, causal half not
  discounted), q . state 2 Cr N P, state update k^T x 2 Cr N P; plus the per-step R x R qk_dot
  2 R^2 N; elementwise work not counted. Achieved TFLOP/s as a fraction of a bf16 matmul ceiling
  (8192^3 torch.matmul, measured in the run).
- Bytes: every input read once plus every output written once (states [B,H,S/C,N,P] dominates
  at small C); achieved bandwidth as a fraction of the copy ceiling (1 GiB device-to-device copy
  measured in the run).
- Agreement: rel_l2 of our outputs vs upstream's on the same inputs, and of both vs the float32
  torch reference (tests/python/mimo_ref.py) of the same inputs (--no-ref skips it).

If tilelang (or upstream's module) cannot be imported, the reason is printed and the comparison
column is the float32 torch reference's wall time instead (clearly labelled: a host-bound
PyTorch implementation, not a kernel). Prints a Markdown table last; with $OUT set, also writes
$OUT/bench_mimo_bwd.{json,md}.

Usage: python bench/bench_mimo_bwd.py [--quick] [--no-upstream] [--no-ref] [--shapes 0,3,10]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import sys
import threading
import time
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TileLang's kernel cache in an ignored folder of the checkout (kept while the machine stays warm).
os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(REPO, "build-tilelang-cache"))
try:
    from mamba3_kernels import mimo
except ImportError:  # running from a source checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(REPO, "python"))
    from mamba3_kernels import mimo
import mamba3_kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
from bench_siso_bwd import (_sleep_cycles_per_ms, copy_ceiling_gbps, gpu_time_ms,  # noqa: E402
                            host_time_ms)
import mimo_ref  # noqa: E402

DEV = "cuda"
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
B, S, H, G = 4, 2048, 16, 1
RDD = 4
SHAPES = [  # (N, P, R, C)
    (16, 64, 4, 8), (32, 64, 4, 16), (64, 64, 4, 16), (128, 64, 4, 16), (256, 64, 4, 8),
    (64, 128, 4, 16), (128, 32, 4, 16), (128, 128, 4, 8), (128, 64, 8, 8), (128, 64, 2, 32),
    (128, 64, 1, 64),
]
N_COPIES = 2
OUT_NAMES = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
ARG_ORDER = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
             "da_cs_rev", "dt", "trap", "segsum")


def label(shape):
    N, P, R, C = shape
    return f"N{N} P{P} R{R} C{C}"


# ----------------------------------------------------------------------------- upstream

def load_upstream():
    """(module, note): the module is None when tilelang or upstream's module cannot be
    imported; the note says why, or what was done to import it."""
    up_dir = os.path.join(REPO, ".upstream")
    if not os.path.isdir(up_dir):
        return None, f"upstream not available: {up_dir} does not exist"
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure is reported and the run goes on
        return None, (f"tilelang cannot be imported ({type(e).__name__}: {e}); set PYTHONPATH "
                      "to a folder where its wheel is installed")
    note = f"tilelang {getattr(tilelang, '__version__', '?')}"
    sys.path.insert(0, up_dir)
    try:
        import einops  # noqa: F401
    except ImportError:
        # Upstream's module imports einops at the top; mamba_mimo_bwd_fwd does not use it.
        stub = types.ModuleType("einops")

        def _unavailable(*a, **k):
            raise RuntimeError("einops is not installed (stub for the benchmark)")
        stub.rearrange = stub.repeat = _unavailable
        sys.modules["einops"] = stub
        note += "; einops not installed: stubbed (unused by the measured kernel)"
    try:
        from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd as up
    except Exception as e:  # noqa: BLE001
        return None, f"upstream import failed: {type(e).__name__}: {e}"
    return up, note


def upstream_config(shape):
    """Keyword arguments of upstream's mamba_mimo_bwd_fwd for one shape (the values its
    mamba_mimo_bwd_combined passes: 128 threads, 0 stages, bf16 states)."""
    N, P, R, C = shape
    return dict(B=B, S=S, H=H, G=G, N=N, P=P, R=R, hasZ=True, hasD=True, reduceO=True,
                fuse_pregate_headwise_rms_norm=False, chunk_size=C, rotary_dim_divisor=RDD,
                dtype="bfloat16", outproj_norm_eps=1e-5, threads=128, num_stages=0,
                states_dtype=BF16)


class Compiler:
    """Compiles upstream's kernel for every shape in parallel threads, in the background."""

    def __init__(self, up, shapes, workers):
        self.kernels, self.errors, self.seconds = {}, {}, {}
        self.t0 = time.perf_counter()
        self.total_s = None
        jit = up.mamba_mimo_bwd_fwd
        compile_one = getattr(jit, "compile", jit)  # JITImpl.compile, else the jit call itself
        init = getattr(jit, "initialize_jit_mode", None)
        if init is not None and shapes:
            # The lazy/eager mode is inferred on first use: once here, not racing in threads.
            try:
                init(**upstream_config(shapes[0]))
            except Exception:  # noqa: BLE001 - the compile itself reports what is wrong
                pass

        def one(shape):
            t = time.perf_counter()
            try:
                self.kernels[shape] = compile_one(**upstream_config(shape))
            except Exception as e:  # noqa: BLE001 - reported per shape
                self.errors[shape] = f"{type(e).__name__}: {str(e)[:300]}"
            self.seconds[shape] = time.perf_counter() - t

        def run():
            with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as ex:
                list(ex.map(one, shapes))
            self.total_s = time.perf_counter() - self.t0
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self, timeout):
        self.thread.join(timeout)
        return not self.thread.is_alive()


# ----------------------------------------------------------------------------- inputs

def make_inputs(shape, seed):
    """Inputs on the GPU in upstream's dtypes, plus upstream's preallocated outputs."""
    N, P, R, C = shape
    g = torch.Generator(device=DEV).manual_seed(seed)
    A = N // RDD
    nch = S // C

    def u(shape_, lo, hi, dtype):
        return (torch.rand(shape_, device=DEV, generator=g, dtype=F32) * (hi - lo) + lo).to(dtype)
    d = dict(dout=u((B, S, H, P), -1, 1, BF16), q=u((B, S, R, G, N), -1, 1, BF16),
             k=u((B, S, R, G, N), -1, 1, BF16), v=u((B, S, H, P), -1, 1, BF16),
             q_bias=u((H, R, N), -0.5, 0.5, F32), k_bias=u((H, R, N), -0.5, 0.5, F32),
             mimo_v=u((H, R, P), -1, 1, F32), mimo_o=u((H, R, P), -1, 1, F32),
             mimo_z=u((H, R, P), -1.5, 1.5, F32), z=u((B, S, H, P), -2, 2, BF16),
             d=u((H,), -1, 1, F32), angles=u((B, S, H, A), -3, 3, F32),
             dt=u((B, H, S), 0.05, 0.6, F32), trap=u((B, H, S), -2, 2, BF16))
    adt = -u((B, H, S), 0.1, 1.5, F64) * d["dt"].to(F64)
    da_cs, da_cs_rev, segsum = mimo_ref.dacs_segsum(adt, C)
    d.update(da_cs=da_cs.to(F32), da_cs_rev=da_cs_rev.to(F32), segsum=segsum.to(F32))
    d["up_out"] = dict(states=torch.empty((B, H, nch, N, P), dtype=BF16, device=DEV),
                       qk_dot=torch.zeros((B, H, S, R, R), dtype=BF16, device=DEV),
                       dmimo_o=torch.empty((B, H, R, P), dtype=F32, device=DEV),
                       dmimo_z=torch.empty((B, H, R, P), dtype=F32, device=DEV),
                       dz=torch.empty((B, S, H, P), dtype=BF16, device=DEV))
    return d


def ours(s, C):
    return mimo.mamba3_mimo_bwd_fwd(*(s[k] for k in ARG_ORDER), mimo_z=s["mimo_z"], d=s["d"],
                                    z=s["z"], chunk_size=C, rotary_dim_divisor=RDD,
                                    output_dtype=BF16)


def upstream_call(kernel, s):
    o = s["up_out"]
    # The argument order of upstream's mamba_mimo_bwd_combined call (no norm: its tensors None).
    kernel(s["dout"], s["q"], s["k"], s["v"], s["q_bias"], s["k_bias"], s["mimo_v"],
           s["mimo_o"], None, o["dmimo_o"], None, None, o["states"], s["z"], s["mimo_z"],
           o["dz"], o["dmimo_z"], s["angles"], s["da_cs"], s["da_cs_rev"], s["dt"], s["trap"],
           s["d"], o["qk_dot"], s["segsum"])
    return tuple(o[n] for n in OUT_NAMES)


def ref_inputs(s, C):
    """The dict mimo_ref.reference takes."""
    r = {k: s[k] for k in ARG_ORDER}
    r.update(mimo_z=s["mimo_z"], d=s["d"], z=s["z"], norm_weight=None, norm_eps=1e-5,
             chunk_size=C, rotary_dim_divisor=RDD)
    return r


# ----------------------------------------------------------------------------- counts

def flops(shape):
    N, P, R, C = shape
    cr = C * R
    nch = S // C
    return B * H * (nch * (2 * cr * cr * (N + P) + 4 * cr * N * P) + S * 2 * R * R * N)


def nbytes(s, outs):
    ins = sum(t.numel() * t.element_size() for k, t in s.items()
              if isinstance(t, torch.Tensor))
    return ins + sum(t.numel() * t.element_size() for t in outs if t is not None)


def matmul_ceiling_tflops(cfg, cpm):
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=BF16)
    b = torch.randn(n, n, device=DEV, dtype=BF16)
    c = torch.empty(n, n, device=DEV, dtype=BF16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    ms = gpu_time_ms(lambda _: torch.matmul(a, b, out=c), [None], cfg.reps, cfg.trials, cpm,
                     0.05)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12, ms


def rel_l2(a, b):
    a, b = a.double(), b.double()
    num = torch.linalg.vector_norm(a - b).item()
    den = torch.linalg.vector_norm(b).item()
    if not math.isfinite(num):
        return math.inf
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def measure(fn, sets, cfg, cpm):
    for i in range(cfg.warmup):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    host = host_time_ms(fn, sets, reps=10)
    return dict(gpu_ms=gpu_time_ms(fn, sets, cfg.reps, cfg.trials, cpm, host),
                host_enqueue_ms=host)


def wall_ms(fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fmt(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


# ----------------------------------------------------------------------------- main

def main():
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--no-ref", dest="ref", action="store_false",
                    help="skip the float32 torch reference (accuracy columns)")
    ap.add_argument("--shapes", default="",
                    help="comma-separated indices into the 11-shape grid (default: all)")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="threads compiling upstream's kernels (default: one per shape, at most "
                         "the number of CPUs)")
    ap.add_argument("--compile-timeout", type=float, default=240.0,
                    help="seconds (from the start of the compiles) after which the ones not "
                         "finished are given up")
    cfg = ap.parse_args()
    cfg.reps, cfg.trials, cfg.warmup = (10, 5, 2) if cfg.quick else (20, 11, 3)
    shapes = SHAPES if not cfg.shapes else [SHAPES[int(i)] for i in cfg.shapes.split(",")]

    torch.backends.cuda.matmul.allow_tf32 = False
    dev_name = torch.cuda.get_device_name()
    print(f"device: {dev_name}; torch {torch.__version__}; library "
          f"{mamba3_kernels.library_path()} (cuda={mamba3_kernels.has_cuda()})", flush=True)

    # Upstream's compiles start first (they take the longest); while they run, only untimed
    # work is done (inputs, our outputs, the float32 reference). All timing comes after them,
    # so compile threads never compete with the host side of a timed loop.
    up, up_note = (None, "upstream skipped (--no-upstream)") if cfg.no_upstream else \
        load_upstream()
    print(up_note, flush=True)
    compiler = None
    if up is not None:
        workers = cfg.compile_workers or min(len(shapes), os.cpu_count() or 1)
        compiler = Compiler(up, shapes, workers)
        print(f"compiling upstream's kernel for {len(shapes)} shapes in {workers} threads "
              f"(cache {os.environ.get('TILELANG_CACHE_DIR')})", flush=True)
    use_ref_timing = up is None

    # ---- phase A (untimed): inputs, our outputs, agreement with the float32 reference
    state = {}
    for shape in shapes:
        N, P, R, C = shape
        row = dict(shape=label(shape), N=N, P=P, R=R, C=C, flops=flops(shape))
        sets = [make_inputs(shape, seed) for seed in range(N_COPIES)]
        mine = None
        try:
            mine = ours(sets[0], C)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - e.g. a build without the MIMO CUDA backend
            row["ours_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{label(shape)}: ours failed: {row['ours_error']}", flush=True)
        row["bytes"] = nbytes({k: v for k, v in sets[0].items() if k != "up_out"},
                              mine if mine is not None else sets[0]["up_out"].values())
        ref = None
        if cfg.ref:
            ref = mimo_ref.reference(ref_inputs(sets[0], C), F32, BF16, golden_order=False)
            ref = tuple(ref[n] for n in OUT_NAMES)
            if mine is not None:
                row["ours_vs_ref_fp32_rel_l2"] = {n: rel_l2(a, b)
                                                  for n, a, b in zip(OUT_NAMES, mine, ref)}
        state[shape] = (row, sets, mine, ref)
        print(f"{label(shape)}: inputs ready" + (
            ", ours vs fp32 reference: " + ", ".join(
                f"{n} {v:.1e}" for n, v in row["ours_vs_ref_fp32_rel_l2"].items())
            if "ours_vs_ref_fp32_rel_l2" in row else ""), flush=True)

    compile_note = ""
    if compiler is not None:
        left = cfg.compile_timeout - (time.perf_counter() - compiler.t0)
        done = compiler.wait(max(0.0, left))
        if done:
            compile_note = (f"upstream compile: {compiler.total_s:.1f} s wall for "
                            f"{len(shapes)} kernels in parallel (per kernel: " + ", ".join(
                                f"{label(s_)} {compiler.seconds.get(s_, 0):.0f} s"
                                for s_ in shapes) + ")")
        else:
            compile_note = (f"upstream compile did not finish within {cfg.compile_timeout:.0f} s "
                            f"({len(compiler.kernels)} of {len(shapes)} kernels ready); "
                            "the missing shapes have no upstream time")
        print(compile_note, flush=True)
        for s_, e in compiler.errors.items():
            print(f"  upstream compile failed for {label(s_)}: {e}", flush=True)

    # ---- phase B (timed): ceilings, then ours and upstream per shape
    cpm = _sleep_cycles_per_ms()
    copy_gbps, copy_ms = copy_ceiling_gbps(cfg, cpm)
    mm_tflops, mm_ms = matmul_ceiling_tflops(cfg, cpm)
    print(f"copy ceiling: {copy_gbps:.0f} GB/s (1 GiB device-to-device copy, {copy_ms:.3f} ms); "
          f"bf16 matmul ceiling: {mm_tflops:.0f} TFLOP/s (8192^3, {mm_ms:.3f} ms)", flush=True)
    rows = []
    for shape in shapes:
        N, P, R, C = shape
        row, sets, mine, ref = state.pop(shape)
        if mine is not None:
            row["ours"] = measure(lambda s: ours(s, C), sets, cfg, cpm)
        theirs = None
        kernel = compiler.kernels.get(shape) if compiler is not None else None
        if compiler is not None:
            row["upstream_compile_s"] = compiler.seconds.get(shape)
            if shape in compiler.errors:
                row["upstream_error"] = "compile: " + compiler.errors[shape]
            elif kernel is None:
                row["upstream_error"] = "compile did not finish in time"
        if kernel is not None:
            try:
                theirs = tuple(t.clone() for t in upstream_call(kernel, sets[0]))
                torch.cuda.synchronize()
                row["upstream"] = measure(lambda s: upstream_call(kernel, s), sets, cfg, cpm)
            except Exception as e:  # noqa: BLE001
                row["upstream_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                theirs = None
        if mine is not None and theirs is not None:
            row["ours_vs_upstream_rel_l2"] = {n: rel_l2(a, b)
                                              for n, a, b in zip(OUT_NAMES, mine, theirs)}
        if ref is not None and theirs is not None:
            row["upstream_vs_ref_fp32_rel_l2"] = {n: rel_l2(a, b)
                                                  for n, a, b in zip(OUT_NAMES, theirs, ref)}
        if use_ref_timing:
            ri = ref_inputs(sets[0], C)
            row["ref_fp32_wall_ms"] = wall_ms(
                lambda: mimo_ref.reference(ri, F32, BF16, golden_order=False), 3)
        o, u = row.get("ours"), row.get("upstream")
        for m in (o, u):
            if m:
                m["tflops"] = row["flops"] / (m["gpu_ms"] * 1e-3) / 1e12
                m["pct_matmul"] = 100 * m["tflops"] / mm_tflops
                m["gbps"] = row["bytes"] / (m["gpu_ms"] * 1e-3) / 1e9
                m["pct_copy"] = 100 * m["gbps"] / copy_gbps
        if o and u:
            row["ratio"] = u["gpu_ms"] / o["gpu_ms"]
        elif o and row.get("ref_fp32_wall_ms"):
            row["ratio_vs_ref"] = row["ref_fp32_wall_ms"] / o["gpu_ms"]
        print(f"{label(shape)}: " + " | ".join(x for x in (
            f"ours {o['gpu_ms']:.4f} ms" if o else row.get("ours_error"),
            f"upstream {u['gpu_ms']:.4f} ms" if u else row.get("upstream_error"),
            f"fp32 torch reference {row['ref_fp32_wall_ms']:.1f} ms (wall)"
            if row.get("ref_fp32_wall_ms") else None) if x), flush=True)
        rows.append(row)
        del sets, mine, theirs, ref
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ report
    ratios = [r.get("ratio") or r.get("ratio_vs_ref") for r in rows]
    ratios = [x for x in ratios if x]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    lines = []
    agree = [r for r in rows if r.get("ours_vs_upstream_rel_l2") or r.get("ours_vs_ref_fp32_rel_l2")]
    if agree:
        lines += ["Agreement (rel_l2; upstream uses fast-math sin/cos/exp and bf16 intermediates, "
                  "so ~1e-3..1e-2 against it is expected):", "",
                  "| shape | output | ours vs upstream | ours vs fp32 ref | upstream vs fp32 ref |",
                  "|---|---|---|---|---|"]
        for r in agree:
            for n in OUT_NAMES:
                cells = [r.get(k, {}).get(n) for k in ("ours_vs_upstream_rel_l2",
                                                       "ours_vs_ref_fp32_rel_l2",
                                                       "upstream_vs_ref_fp32_rel_l2")]
                lines.append(f"| {r['shape']} | {n} | " + " | ".join(
                    "n/a" if c is None else f"{c:.1e}" for c in cells) + " |")
        lines.append("")
    cmp_name = "upstream" if not use_ref_timing else "fp32 torch ref (wall, NOT a kernel)"
    lines += [f"Device {dev_name}; copy ceiling {copy_gbps:.0f} GB/s; bf16 matmul ceiling "
              f"{mm_tflops:.0f} TFLOP/s. B={B} S={S} H={H} G={G}, bf16 I/O, Z and D, reduce-O, "
              f"bf16 states. Ratio = {cmp_name} time / ours (> 1: ours faster). {up_note}."
              + (f" {compile_note}." if compile_note else ""), ""]
    if use_ref_timing:
        lines += ["**Upstream could not run: the comparison column is the float32 PyTorch "
                  "reference (tests/python/mimo_ref.py), timed by wall clock.**", ""]
    lines += [f"| shape (N,P,R,C) | ours GPU ms | {cmp_name} ms | ratio | GFLOP | ours TFLOP/s "
              "(% mm) | upstream TFLOP/s (% mm) | MB | ours GB/s (% copy) | upstream GB/s "
              "(% copy) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, u = r.get("ours"), r.get("upstream")
        other = (fmt(u["gpu_ms"], 4) if u else r.get("upstream_error", "n/a")[:40]) \
            if not use_ref_timing else fmt(r.get("ref_fp32_wall_ms"), 1)
        ratio = r.get("ratio") or r.get("ratio_vs_ref")

        def perf(m):
            return (f"{m['tflops']:.1f} ({m['pct_matmul']:.1f}%)" if m else "n/a",
                    f"{m['gbps']:.0f} ({m['pct_copy']:.1f}%)" if m else "n/a")
        (ot, ob), (ut, ub) = perf(o), perf(u)
        lines.append(f"| {r['shape']} | {fmt(o['gpu_ms'], 4) if o else r.get('ours_error', 'n/a')[:40]}"
                     f" | {other} | {fmt(ratio, 2)} | {r['flops'] / 1e9:.1f} | {ot} | {ut} | "
                     f"{r['bytes'] / 1e6:.0f} | {ob} | {ub} |")
    if geo is not None:
        lines.append(f"| **geometric mean ({len(ratios)} shapes)** | | | **{geo:.2f}** | | | | "
                     "| | |")
    total_s = time.perf_counter() - t_start
    lines += ["", f"Whole run: {total_s:.0f} s."]
    text = "\n".join(lines)
    print()
    print(text, flush=True)

    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_mimo_bwd.json"), "w") as f:
            json.dump(dict(device=dev_name, torch=torch.__version__,
                           library=mamba3_kernels.library_path(), copy_ceiling_gbps=copy_gbps,
                           matmul_ceiling_tflops=mm_tflops, upstream_note=up_note,
                           compile_note=compile_note, geomean_ratio=geo,
                           comparison=cmp_name, total_s=total_s, rows=rows), f, indent=1)
        with open(os.path.join(out_dir, "bench_mimo_bwd.md"), "w") as f:
            f.write(text + "\n")
    if compiler is not None and compiler.thread.is_alive():
        # Compile threads that are still running would keep the interpreter from exiting.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
