#!/usr/bin/env python3
"""Benchmark of the MIMO backward against upstream mamba_ssm's TileLang implementation, in one
process on one GPU (SPEC.md section 4). --op selects what is measured:
  bwd_fwd  (default) mamba3_mimo_bwd_fwd vs upstream's kernel mamba_mimo_bwd_fwd
  bwd_bwd  mamba3_mimo_bwd_bwd vs upstream's kernel mamba_mimo_bwd_bwd (hasZ=False, hasD=True,
           reduceO=True, packed_dout=False, 256 threads): the same bf16 states / qk_dot (made
           once per input set by our first pass) fed to both; DQ/DK/DV bf16, the rest f32
  combined mamba3_mimo_bwd_combined vs upstream's Python function mamba_mimo_bwd_combined (its
           two kernels plus its torch/Triton reductions and allocations, timed end to end as GPU
           time), z, mimo_z, D and mimo_o on, no norm
  combined_norm  the same with the fused pre-gate norm (norm_weight; upstream's
           fuse_pregate_headwise_rms_norm: its norm first pass and packed-dout second pass);
           ours computes dD in float64 there (src/cuda/mimo_norm_dd_f64.cuh)
  all      bwd_fwd, bwd_bwd and combined in sequence in one process (one ceilings measurement,
           one set of upstream compile threads for every kernel needed)

Shapes: the 11-shape grid B=4, S=2048, H=16, G=1 over (N, P, R, C); bf16 activations (dout, q,
k, v, z) and trap, f32 q/k biases, mimo_v/o/z, D, angles, dt, da_cs, da_cs_rev, segsum (the
dtypes upstream's kernel takes), Z and D on, reduce-O, no norm, rotary divisor 4; states, qk_dot
and dz in bf16 for both implementations.

Measured per shape:
- GPU time: median over trials of (CUDA-event time around `reps` back-to-back calls) / reps,
  each trial behind a GPU sleep long enough for the host to enqueue all calls (device time only;
  bench_siso_bwd.py's method). Inputs rotate among 2 copies, and so do outputs (each call's kept
  until two calls later; from session 37). Ours through the Python function (it allocates its
  outputs), upstream's compiled kernel object with preallocated outputs, one set per input set
  (combined: upstream's Python function, which allocates its own).
- Upstream compile: every kernel the selected ops need (bwd_fwd; bwd_bwd without Z; bwd_bwd with
  Z for combined) for every shape, compiled before any timing, in parallel threads, through the
  jit object's call in the form mamba_mimo_bwd_combined uses (so that function finds them in the
  jit cache); wall time per kernel and in total are reported; TileLang's disk cache,
  TILELANG_CACHE_DIR, makes a second run on the same machine skip it. Compiles not finished
  within --compile-timeout seconds (default 240 per kernel kind) are given up (those shapes
  have no upstream column). --compile-only fills that cache and exits, also on a machine
  without a GPU (target sm_90a; scripts/pack_for_device.sh --upstream-cache carries it), so a
  device call need not spend its minutes compiling.
- FLOPs (the same count for both): the chunked algorithm's matrix products, with Cr = C*R per
  chunk and head (dense blocks, causal half not discounted; elementwise work, rotary, exp and
  reductions not counted):
    bwd_fwd  q k^T scores 2 Cr^2 N, scores x 2 Cr^2 P, q . state 2 Cr N P, state update k^T x
             2 Cr N P; per step the R x R qk_dot 2 R^2 N.
             Per chunk 2 Cr^2 (N + P) + 4 Cr N P, plus 2 R^2 N per step.
    bwd_bwd  (golden/include/mamba3_golden/mimo_bwd_bwd.hpp) recomputed scores qh kh^T 2 Cr^2 N;
             dscores = dPhiO x^T 2 Cr^2 P (also feeds DSSDA); dx intra = scores^T dPhiO
             2 Cr^2 P; dq intra = dscores kh 2 Cr^2 N; dk intra = dscores^T qh 2 Cr^2 N;
             dq inter = dPhiO St^T 2 Cr N P; dx inter = kh dS 2 Cr N P; dk inter = x dS^T
             2 Cr N P; dS update qh^T dPhiO 2 Cr N P; per step the R x R diagonal: dqk_dot =
             dPhiO . x 2 R^2 P, dx from qk_dot 2 R^2 P, dq / dk from dqk_dot 2 R^2 N each.
             Per chunk Cr^2 (6 N + 4 P) + 8 Cr N P, plus 4 R^2 (N + P) per step (about 2-3x
             bwd_fwd).
    combined bwd_fwd + bwd_bwd (the reductions are elementwise).
  Achieved TFLOP/s as a fraction of a bf16 matmul ceiling (8192^3 torch.matmul, measured in the
  run).
- Bytes: every input read once plus every output written once (states [B,H,S/C,N,P] dominates
  at small C; bwd_bwd reads states and qk_dot; combined counts only its raw inputs and final
  gradients, not the states it passes between its kernels); achieved bandwidth as a fraction of
  the copy ceiling (1 GiB device-to-device copy measured in the run).
- Agreement: rel_l2 of our outputs vs upstream's on the same inputs, and of both vs the float32
  torch reference (tests/python/mimo_ref.py) of the same inputs (--no-ref skips it). The
  reference of bwd_bwd / combined (torch.autograd of the chunked forward) costs about 2x the
  first pass's (host time and memory, measured on the CPU at B=1 S=512 H=4), so it is on by
  default too; --ref-fwd-only keeps it for bwd_fwd only (the other tables then say so and rely
  on ours vs upstream).

If tilelang (or upstream's module) cannot be imported, the reason is printed and the comparison
column is the float32 torch reference's wall time instead (clearly labelled: a host-bound
PyTorch implementation, not a kernel; bwd_bwd / combined with --ref-fwd-only have no
comparison column then). Prints the Markdown table(s) last; with $OUT set, also writes one
JSON and one table per op: $OUT/bench_mimo_bwd.{json,md} (bwd_fwd),
$OUT/bench_mimo_bwd_bwd.{json,md}, $OUT/bench_mimo_combined.{json,md}.

Usage: python bench/bench_mimo_bwd.py [--op bwd_fwd|bwd_bwd|combined|all] [--quick]
           [--no-upstream] [--no-ref] [--ref-fwd-only] [--shapes 0,3,10]
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
                            host_time_ms, keeping_outputs)
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
OPS = ("bwd_fwd", "bwd_bwd", "combined", "combined_norm")
OPS_ALL = ("bwd_fwd", "bwd_bwd", "combined")  # --op all (combined_norm on request)
OUT_FILE = {"bwd_fwd": "bench_mimo_bwd", "bwd_bwd": "bench_mimo_bwd_bwd",
            "combined": "bench_mimo_combined", "combined_norm": "bench_mimo_combined_norm"}
BB_OUT_NAMES = mimo.BWD_BWD_OUTPUTS
CB_OUT_NAMES = mimo.COMBINED_OUTPUTS
# Upstream kernels each op needs: bwd_fwd (Z, D, reduce-O), bwd_bwd without Z (the bwd_bwd op),
# bwd_bwd with Z (what mamba_mimo_bwd_combined builds when z is given).
# With the fused norm its first pass runs the norm variant and its second pass the packed
# pre-RMS dout without Z or reduce-O (mamba_mimo_bwd_combined with
# fuse_pregate_headwise_rms_norm=True).
UP_KINDS = {"bwd_fwd": ("bwd_fwd",), "bwd_bwd": ("bwd_bwd",), "combined": ("bwd_fwd", "bwd_bwd_z"),
            "combined_norm": ("bwd_fwd_norm", "bwd_bwd_packed")}


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
        # Upstream's module imports einops at the top; the measured functions do not use it.
        stub = types.ModuleType("einops")

        def _unavailable(*a, **k):
            raise RuntimeError("einops is not installed (stub for the benchmark)")
        stub.rearrange = stub.repeat = _unavailable
        sys.modules["einops"] = stub
        note += "; einops not installed: stubbed (unused by the measured kernels)"
    try:
        from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd as up
    except Exception as e:  # noqa: BLE001
        return None, f"upstream import failed: {type(e).__name__}: {e}"
    return up, note


def upstream_args(kind, shape):
    """(jit function name, positional arguments, keyword arguments) of one upstream kernel, in
    the form upstream's mamba_mimo_bwd_combined calls it (the same values and the same call form,
    so the kernels compiled here are the ones its jit cache hands that function): bwd_fwd with
    Z, D, reduce-O, no norm, 128 threads; bwd_bwd with D, reduce-O, plain dout, 256 threads, Z
    off ("bwd_bwd") or on ("bwd_bwd_z"); 0 stages and bf16 states for all."""
    N, P, R, C = shape
    if kind in ("bwd_fwd", "bwd_fwd_norm"):
        return ("mamba_mimo_bwd_fwd",
                (B, S, H, G, N, P, R, True, True, True, kind == "bwd_fwd_norm", C, RDD,
                 "bfloat16", 1e-5, 128, 0), dict(states_dtype=BF16))
    if kind == "bwd_bwd_packed":  # (hasZ, D, reduce-O, packed dout)
        return ("mamba_mimo_bwd_bwd",
                (B, S, H, G, N, P, R, False, True, False, True, C, RDD, "bfloat16", 256, 0),
                dict(states_dtype=BF16))
    return ("mamba_mimo_bwd_bwd",
            (B, S, H, G, N, P, R, kind == "bwd_bwd_z", True, True, False, C, RDD, "bfloat16",
             256, 0), dict(states_dtype=BF16))


class Compiler:
    """Compiles the upstream kernels of every (kind, shape) in parallel threads, in the
    background, through the jit object's call (which keeps them in its cache)."""

    def __init__(self, up, jobs, workers):
        self.kernels, self.errors, self.seconds = {}, {}, {}
        self.t0 = time.perf_counter()
        self.total_s = None
        inited = set()
        for kind, shape in jobs:
            name, a, kw = upstream_args(kind, shape)
            init = getattr(getattr(up, name), "initialize_jit_mode", None)
            if init is not None and name not in inited:
                inited.add(name)
                # The lazy/eager mode is inferred on first use: once here, not racing in threads.
                try:
                    init(*a, **kw)
                except Exception:  # noqa: BLE001 - the compile itself reports what is wrong
                    pass

        def one(job):
            t = time.perf_counter()
            name, a, kw = upstream_args(*job)
            try:
                self.kernels[job] = getattr(up, name)(*a, **kw)
            except Exception as e:  # noqa: BLE001 - reported per kernel
                self.errors[job] = f"{type(e).__name__}: {str(e)[:300]}"
            self.seconds[job] = time.perf_counter() - t

        def run():
            with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as ex:
                list(ex.map(one, jobs))
            self.total_s = time.perf_counter() - self.t0
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self, timeout):
        self.thread.join(timeout)
        return not self.thread.is_alive()


# ----------------------------------------------------------------------------- inputs

def make_inputs(shape, seed):
    """Inputs on the GPU in upstream's dtypes ("_adt": the float64 adt the decays come from)."""
    N, P, R, C = shape
    g = torch.Generator(device=DEV).manual_seed(seed)
    A = N // RDD

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
    d.update(da_cs=da_cs.to(F32), da_cs_rev=da_cs_rev.to(F32), segsum=segsum.to(F32), _adt=adt)
    # The fused norm's weight (combined_norm), from its own generator: the other inputs are the
    # same values as without it.
    gn = torch.Generator(device=DEV).manual_seed(seed + 7)
    d["norm_weight"] = torch.rand((H, P), device=DEV, generator=gn, dtype=F32) + 0.5
    return d


def empty(shape, dtype):
    return torch.empty(shape, dtype=dtype, device=DEV)


# ---- bwd_fwd

FWD_INPUTS = ARG_ORDER + ("mimo_z", "d", "z")


def fwd_prepare(s, shape):
    """Upstream's preallocated outputs of the first pass."""
    N, P, R, C = shape
    s["up_out"] = dict(states=empty((B, H, S // C, N, P), BF16),
                       qk_dot=torch.zeros((B, H, S, R, R), dtype=BF16, device=DEV),
                       dmimo_o=empty((B, H, R, P), F32), dmimo_z=empty((B, H, R, P), F32),
                       dz=empty((B, S, H, P), BF16))


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


def fwd_ref(s, C):
    ref = mimo_ref.reference(ref_inputs(s, C), F32, BF16, golden_order=False)
    return tuple(ref[n] for n in OUT_NAMES)


# ---- bwd_bwd

BB_INPUTS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "states", "qk_dot", "da_cs",
             "da_cs_rev", "dt", "trap", "segsum", "angles", "mimo_o", "d")


def bb_prepare(s, shape):
    """The bf16 states / qk_dot both second passes read (our first pass of these inputs; the
    float32 torch chunked readout if ours cannot run), and upstream's preallocated outputs (its
    kernel writes every element of each, so they are not cleared between calls)."""
    N, P, R, C = shape
    try:
        states, qk_dot = ours(s, C)[:2]
    except Exception:  # noqa: BLE001 - e.g. a build without the MIMO CUDA backend
        _, states, qk_dot = mimo_ref.chunked_readout(ref_inputs(s, C), F32)
    s["states"] = states.to(BF16).contiguous()
    s["qk_dot"] = qk_dot.to(BF16).contiguous()
    nch, A = S // C, N // RDD
    s["bb_out"] = dict(DQ=empty((B, S * R, H, N), BF16), DK=empty((B, S * R, H, N), BF16),
                       DV=empty((B, S, H, P), BF16), DMIMO_V=empty((B, H, R, P), F32),
                       DANGLES=empty((B, S, H, A), F32), DFACTOR=empty((B, H, S), F32),
                       DGAMMA=empty((B, H, S), F32), DDA=empty((B, H, S), F32),
                       DSSDA=empty((B, H, nch, C, C), F32), DDA_CS_REV=empty((B, H, S), F32),
                       DDA_CS=empty((B, H, S), F32), DD=empty((B, H), F32))


def bb_ours(s, C):
    out = mimo.mamba3_mimo_bwd_bwd(*(s[k] for k in BB_INPUTS[:15]), mimo_o=s["mimo_o"],
                                   d=s["d"], chunk_size=C, rotary_dim_divisor=RDD,
                                   output_dtype=BF16)
    return tuple(out[n] for n in BB_OUT_NAMES)


def bb_upstream_call(kernel, s):
    o = s["bb_out"]
    # The prim_func's parameter order; hasZ=False: Z and MIMO_Z are not read (None, as
    # upstream's mamba_mimo_bwd_combined passes them without z).
    kernel(s["dout"], s["q"], s["k"], s["v"], s["q_bias"], s["k_bias"], s["mimo_v"],
           s["mimo_o"], o["DK"], o["DV"], o["DMIMO_V"], s["states"], o["DQ"], None, None,
           s["angles"], s["da_cs"], s["da_cs_rev"], s["dt"], s["trap"], o["DFACTOR"],
           o["DGAMMA"], o["DANGLES"], s["d"], o["DD"], s["qk_dot"], o["DDA"], o["DSSDA"],
           o["DDA_CS_REV"], o["DDA_CS"], s["segsum"])
    return tuple(o[n] for n in BB_OUT_NAMES)


def bb_ref(s, C):
    r = {k: s[k] for k in BB_INPUTS}
    r.update(chunk_size=C, rotary_dim_divisor=RDD, layout="reduce")
    ref = mimo_ref.bwd_bwd_reference(r, F32, BF16)
    return tuple(ref[n] for n in BB_OUT_NAMES)


# ---- combined

CB_ARGS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "z", "mimo_z",
           "angles", "da_cs", "da_cs_rev", "dt", "trap", "d", "segsum")


def cb_ours(s, C):
    return mimo.mamba3_mimo_bwd_combined(*(s[k] for k in CB_ARGS), C, RDD)


def cb_upstream_call(up, s, C):
    # Its own allocations, two kernels (from the jit cache filled by Compiler), reductions.
    return tuple(up.mamba_mimo_bwd_combined(*(s[k] for k in CB_ARGS), C, RDD, "bfloat16"))


def cb_ref(s, C, norm=False):
    r = {k: s[k] for k in CB_ARGS}
    r.update(norm_weight=s["norm_weight"] if norm else None, norm_eps=1e-5, chunk_size=C,
             rotary_dim_divisor=RDD, _adt=s["_adt"])
    ref = mimo_ref.combined_reference(r, F32)
    return tuple(ref[n] for n in CB_OUT_NAMES)


# ---- combined with the fused pre-gate norm (its dD in float64: mimo_norm_dd_f64.cuh)

def cbn_ours(s, C):
    return mimo.mamba3_mimo_bwd_combined(*(s[k] for k in CB_ARGS), C, RDD,
                                         norm_weight=s["norm_weight"])


def cbn_upstream_call(up, s, C):
    return tuple(up.mamba_mimo_bwd_combined(*(s[k] for k in CB_ARGS), C, RDD, "bfloat16",
                                            fuse_pregate_headwise_rms_norm=True,
                                            outproj_norm_weight=s["norm_weight"]))


class Op:
    def __init__(self, name, out_names, inputs, prepare, ours, upstream, ref, flops, what):
        self.name, self.out_names, self.inputs, self.prepare = name, out_names, inputs, prepare
        self.ours, self.upstream, self.ref, self.flops = ours, upstream, ref, flops
        self.what = what


# ----------------------------------------------------------------------------- counts

def flops(shape):
    """bwd_fwd: per chunk 2 Cr^2 (N + P) + 4 Cr N P, plus 2 R^2 N per step (module docstring)."""
    N, P, R, C = shape
    cr = C * R
    nch = S // C
    return B * H * (nch * (2 * cr * cr * (N + P) + 4 * cr * N * P) + S * 2 * R * R * N)


def bb_flops(shape):
    """bwd_bwd: per chunk Cr^2 (6 N + 4 P) + 8 Cr N P, plus 4 R^2 (N + P) per step."""
    N, P, R, C = shape
    cr = C * R
    nch = S // C
    return B * H * (nch * (cr * cr * (6 * N + 4 * P) + 8 * cr * N * P) + S * 4 * R * R * (N + P))


def cb_flops(shape):
    return flops(shape) + bb_flops(shape)


def nbytes(tensors, outs):
    ins = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
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


def sync():
    if DEV != "cpu":
        torch.cuda.synchronize()


def measure(fn, sets, cfg, cpm):
    # Outputs rotate as the inputs do (bench_siso_bwd.py's method since session 37): ours are
    # allocated per call, and without this every call would get the same memory, which the
    # previous call may have left in L2; upstream's preallocated outputs are one set per input set.
    fn = keeping_outputs(fn, len(sets))
    for i in range(cfg.warmup):
        fn(sets[i % len(sets)])
    sync()
    if DEV == "cpu":  # the hidden --device cpu smoke mode: host wall time, labelled gpu_ms
        return dict(gpu_ms=statistics.median(
            wall_ms(lambda: fn(sets[i % len(sets)]), 1) for i in range(cfg.reps)),
            host_enqueue_ms=None)
    host = host_time_ms(fn, sets, reps=10)
    return dict(gpu_ms=gpu_time_ms(fn, sets, cfg.reps, cfg.trials, cpm, host),
                host_enqueue_ms=host)


def wall_ms(fn, reps):
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fmt(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


# ----------------------------------------------------------------------------- main

def make_ops(up):
    return {
        "bwd_fwd": Op("bwd_fwd", OUT_NAMES, FWD_INPUTS, fwd_prepare, ours,
                      lambda ks, s, C: upstream_call(ks[0], s), fwd_ref, flops,
                      "mamba3_mimo_bwd_fwd vs upstream mamba_mimo_bwd_fwd; Z and D, reduce-O, "
                      "bf16 states"),
        "bwd_bwd": Op("bwd_bwd", BB_OUT_NAMES, BB_INPUTS, bb_prepare, bb_ours,
                      lambda ks, s, C: bb_upstream_call(ks[0], s), bb_ref, bb_flops,
                      "mamba3_mimo_bwd_bwd vs upstream mamba_mimo_bwd_bwd (hasZ=False, D, "
                      "reduce-O); the same bf16 states / qk_dot for both; DQ/DK/DV bf16"),
        "combined": Op("combined", CB_OUT_NAMES, CB_ARGS, None, cb_ours,
                       lambda ks, s, C: cb_upstream_call(up, s, C), cb_ref, cb_flops,
                       "mamba3_mimo_bwd_combined vs upstream mamba_mimo_bwd_combined (Python "
                       "function, end to end: allocations, two kernels, reductions); Z, D, "
                       "reduce-O, no norm"),
        "combined_norm": Op("combined_norm", CB_OUT_NAMES, CB_ARGS + ("norm_weight",), None,
                            cbn_ours, lambda ks, s, C: cbn_upstream_call(up, s, C),
                            lambda s, C: cb_ref(s, C, norm=True), cb_flops,
                            "mamba3_mimo_bwd_combined vs upstream mamba_mimo_bwd_combined with "
                            "the fused pre-gate norm (fuse_pregate_headwise_rms_norm); Z, D, "
                            "reduce-O; our dD in float64"),
    }


def agree(names, a, b):
    """rel_l2 per output present in both (the same number of elements in another shape, e.g. a
    [B,S,R,H,N] view of a [B,S*R,H,N] tensor, is compared flat; other mismatches are NaN)."""
    res = {}
    for n, x, y in zip(names, a, b):
        if x is None or y is None:
            continue
        if x.shape != y.shape:
            if x.numel() != y.numel():
                res[n] = math.nan
                continue
            x, y = x.reshape(-1), y.reshape(-1)
        res[n] = rel_l2(x, y)
    return res


def run_op(op, shapes, sets_of, cfg, compiler, ref_timing, cpm, mm_tflops, copy_gbps):
    """Phase B of one op (its phase-A results are in op.state): rows of the table."""
    rows = []
    for shape in shapes:
        N, P, R, C = shape
        row, mine, ref = op.state.pop(shape)
        sets = sets_of[shape]
        if mine is not None:
            row["ours"] = measure(lambda s: op.ours(s, C), sets, cfg, cpm)
        theirs = None
        kernels = None
        if compiler is not None:
            jobs = [(kind, shape) for kind in UP_KINDS[op.name]]
            secs = {k: compiler.seconds.get(j) for k, j in zip(UP_KINDS[op.name], jobs)}
            row["upstream_compile_s"] = secs if len(secs) > 1 else secs[UP_KINDS[op.name][0]]
            errs = [compiler.errors[j] for j in jobs if j in compiler.errors]
            if errs:
                row["upstream_error"] = "compile: " + "; ".join(errs)
            elif any(j not in compiler.kernels for j in jobs):
                row["upstream_error"] = "compile did not finish in time"
            else:
                kernels = [compiler.kernels[j] for j in jobs]
        if kernels is not None:
            try:
                theirs = tuple(None if t is None else t.clone()
                               for t in op.upstream(kernels, sets[0], C))
                sync()
                row["upstream"] = measure(lambda s: op.upstream(kernels, s, C), sets, cfg, cpm)
            except Exception as e:  # noqa: BLE001
                row["upstream_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                theirs = None
        if mine is not None and theirs is not None:
            row["ours_vs_upstream_rel_l2"] = agree(op.out_names, mine, theirs)
        if ref is not None and theirs is not None:
            row["upstream_vs_ref_fp32_rel_l2"] = agree(op.out_names, theirs, ref)
        if ref_timing and "ref_error" not in row:
            row["ref_fp32_wall_ms"] = wall_ms(lambda: op.ref(sets[0], C), 3)
        o, u = row.get("ours"), row.get("upstream")
        for m_ in (o, u):
            if m_:
                m_["tflops"] = row["flops"] / (m_["gpu_ms"] * 1e-3) / 1e12
                m_["pct_matmul"] = 100 * m_["tflops"] / mm_tflops if mm_tflops else None
                m_["gbps"] = row["bytes"] / (m_["gpu_ms"] * 1e-3) / 1e9
                m_["pct_copy"] = 100 * m_["gbps"] / copy_gbps if copy_gbps else None
        if o and u:
            row["ratio"] = u["gpu_ms"] / o["gpu_ms"]
        elif o and row.get("ref_fp32_wall_ms"):
            row["ratio_vs_ref"] = row["ref_fp32_wall_ms"] / o["gpu_ms"]
        print(f"[{op.name}] {label(shape)}: " + " | ".join(x for x in (
            f"ours {o['gpu_ms']:.4f} ms" if o else row.get("ours_error"),
            f"upstream {u['gpu_ms']:.4f} ms" if u else row.get("upstream_error"),
            f"fp32 torch reference {row['ref_fp32_wall_ms']:.1f} ms (wall)"
            if row.get("ref_fp32_wall_ms") else None) if x), flush=True)
        rows.append(row)
        del mine, theirs, ref
        if DEV != "cpu":
            torch.cuda.empty_cache()
    return rows


def report(op, rows, dev_name, copy_gbps, mm_tflops, up_note, compile_note, use_ref_timing,
           ref_on):
    ratios = [r.get("ratio") or r.get("ratio_vs_ref") for r in rows]
    ratios = [x for x in ratios if x]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    header = f"### MIMO {op.name}: {op.what}"
    lines = []
    agree_rows = [r for r in rows if r.get("ours_vs_upstream_rel_l2")
                  or r.get("ours_vs_ref_fp32_rel_l2")]
    if agree_rows:
        lines += ["Agreement (rel_l2; upstream uses fast-math sin/cos/exp and bf16 intermediates, "
                  "so ~1e-3..1e-2 against it is expected)" + (
                      "" if ref_on else "; fp32 reference columns not computed for this op "
                      "(--no-ref or --ref-fwd-only)") + ":", "",
                  "| shape | output | ours vs upstream | ours vs fp32 ref | upstream vs fp32 ref |",
                  "|---|---|---|---|---|"]
        for r in agree_rows:
            for n in op.out_names:
                cells = [r.get(k, {}).get(n) for k in ("ours_vs_upstream_rel_l2",
                                                       "ours_vs_ref_fp32_rel_l2",
                                                       "upstream_vs_ref_fp32_rel_l2")]
                if all(c is None for c in cells):
                    continue
                lines.append(f"| {r['shape']} | {n} | " + " | ".join(
                    "n/a" if c is None else f"{c:.1e}" for c in cells) + " |")
    agreement = "\n".join(lines)
    lines = []
    cmp_name = "upstream" if not use_ref_timing else "fp32 torch ref (wall, NOT a kernel)"
    lines += [f"Device {dev_name}; copy ceiling {fmt(copy_gbps, 0)} GB/s; bf16 matmul ceiling "
              f"{fmt(mm_tflops, 0)} TFLOP/s. B={B} S={S} H={H} G={G}, bf16 I/O. "
              f"Ratio = {cmp_name} time / ours (> 1: ours faster). {up_note}."
              + (f" {compile_note}." if compile_note else ""), ""]
    if use_ref_timing:
        lines += ["**Upstream could not run: the comparison column is the float32 PyTorch "
                  "reference (tests/python/mimo_ref.py), timed by wall clock"
                  + ("" if any(r.get("ref_fp32_wall_ms") for r in rows)
                     else " (not run for this op: --ref-fwd-only)") + ".**", ""]
    lines += [f"| shape (N,P,R,C) | ours GPU ms | {cmp_name} ms | ratio | GFLOP | ours TFLOP/s "
              "(% mm) | upstream TFLOP/s (% mm) | MB | ours GB/s (% copy) | upstream GB/s "
              "(% copy) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, u = r.get("ours"), r.get("upstream")
        other = (fmt(u["gpu_ms"], 4) if u else r.get("upstream_error", "n/a")[:40]) \
            if not use_ref_timing else fmt(r.get("ref_fp32_wall_ms"), 1)
        ratio = r.get("ratio") or r.get("ratio_vs_ref")

        def perf(m_):
            return (f"{m_['tflops']:.1f} ({fmt(m_['pct_matmul'], 1)}%)" if m_ else "n/a",
                    f"{m_['gbps']:.0f} ({fmt(m_['pct_copy'], 1)}%)" if m_ else "n/a")
        (ot, ob), (ut, ub) = perf(o), perf(u)
        lines.append(f"| {r['shape']} | {fmt(o['gpu_ms'], 4) if o else r.get('ours_error', 'n/a')[:40]}"
                     f" | {other} | {fmt(ratio, 2)} | {r['flops'] / 1e9:.1f} | {ot} | {ut} | "
                     f"{r['bytes'] / 1e6:.0f} | {ob} | {ub} |")
    if geo is not None:
        lines.append(f"| **geometric mean ({len(ratios)} shapes)** | | | **{geo:.2f}** | | | | "
                     "| | |")
    return header, agreement, "\n".join(lines), geo, cmp_name


def late_compile_note(limit_s, ready_then, total, ready_end=None):
    """The note for upstream compiles that passed their time limit: how many kernels were
    ready then and, once the run has timed its shapes, how many by its end (a kernel finished
    after the limit is timed if it is ready by its shape's turn)."""
    if ready_end is None:
        counts = f"{ready_then} of {total} kernels ready"
    else:
        counts = (f"{ready_then} of {total} kernels ready then, {ready_end} by the end of the "
                  "run; a kernel that was ready by its shape's turn was timed, so compiles ran "
                  "beside part of the timed phase")
    return (f"upstream compile did not finish within {limit_s:.0f} s ({counts}); "
            "the shapes missing one have no upstream time")


def upstream_kinds(op_names):
    """The upstream kernel kinds these ops need, each once, in order."""
    kinds = []
    for n in op_names:
        kinds += [k for k in UP_KINDS[n] if k not in kinds]
    return kinds


def compile_only(op_names, shapes, workers):
    """Fills TILELANG_CACHE_DIR with upstream's kernels for these ops and shapes, through the
    same calls as the timed run (so that its jit calls find them there); returns the exit code.
    TileLang's cache key holds the target's string, which 'auto' makes on an H100 / H200 from
    the device (sm_90a): without a device the same target comes from TILELANG_TARGET. The key
    also holds libtilelang.so's size and mtime, so the tilelang that compiles must be the one
    the device imports (the same unpacked site: pack_for_device.sh does both)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TILELANG_TARGET", "cuda -arch=sm_90a")
    up, note = load_upstream()
    print(note, flush=True)
    if up is None:
        return 1
    kinds = upstream_kinds(op_names)
    jobs = [(kind, shape) for shape in shapes for kind in kinds]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    print(f"compiling {len(jobs)} upstream kernels ({', '.join(kinds)}) in {workers} threads "
          f"into {os.environ.get('TILELANG_CACHE_DIR')} (target "
          f"{os.environ.get('TILELANG_TARGET', 'auto')})", flush=True)
    compiler = Compiler(up, jobs, workers)
    compiler.wait(None)
    for job in jobs:
        k, s_ = job
        err = compiler.errors.get(job)
        print(f"  {k} {label(s_)}: {compiler.seconds.get(job, 0):.0f} s"
              + (f", failed: {err}" if err else ""), flush=True)
    print(f"{len(compiler.kernels)} of {len(jobs)} compiled in {compiler.total_s:.0f} s",
          flush=True)
    return 0 if len(compiler.kernels) == len(jobs) else 1


def main():
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="bwd_fwd",
                    help="what to measure: bwd_fwd (default), bwd_bwd, combined, combined_norm "
                         "(the combined backward with the fused norm), a comma-separated list of "
                         "them, or all (the first three in one process)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--no-ref", dest="ref", action="store_false",
                    help="skip the float32 torch reference (accuracy columns)")
    ap.add_argument("--ref-fwd-only", action="store_true",
                    help="run the float32 torch reference for bwd_fwd only (not for bwd_bwd "
                         "and combined, whose autograd reference costs about twice as much)")
    ap.add_argument("--shapes", default="",
                    help="comma-separated indices into the 11-shape grid (default: all)")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="threads compiling upstream's kernels (default: one per kernel, at "
                         "most the number of CPUs)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile upstream's kernels for --op / --shapes into TILELANG_CACHE_DIR "
                         "and exit (no GPU needed: without one the target is "
                         "TILELANG_TARGET, default 'cuda -arch=sm_90a', the H100 / H200's)")
    ap.add_argument("--compile-timeout", type=float, default=0.0,
                    help="seconds (from the start of the compiles) after which the ones not "
                         "finished are given up (default 240 per kind of kernel needed)")
    # Hidden: a CPU smoke test of the script itself (the library's CPU backend, host timing,
    # no ceilings, no upstream); --tiny: B=1, S=64, H=2.
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    cfg = ap.parse_args()
    global DEV, B, S, H
    DEV = cfg.device
    if cfg.tiny:
        B, S, H = 1, 64, 2
    if DEV == "cpu":
        cfg.no_upstream = True
    cfg.reps, cfg.trials, cfg.warmup = (10, 5, 2) if cfg.quick else (20, 11, 3)
    shapes = SHAPES if not cfg.shapes else [SHAPES[int(i)] for i in cfg.shapes.split(",")]
    op_names = list(OPS_ALL) if cfg.op == "all" else [o.strip() for o in cfg.op.split(",")]
    bad = [o for o in op_names if o not in OPS]
    if bad:
        ap.error(f"--op: unknown {', '.join(bad)} (choose from {', '.join(OPS)}, or all)")

    if cfg.compile_only:
        sys.exit(compile_only(op_names, shapes, cfg.compile_workers))
    torch.backends.cuda.matmul.allow_tf32 = False
    dev_name = torch.cuda.get_device_name() if DEV != "cpu" else \
        "cpu (smoke test: host wall times, no ceilings)"
    print(f"device: {dev_name}; torch {torch.__version__}; library "
          f"{mamba3_kernels.library_path()} (cuda={mamba3_kernels.has_cuda()}); ops "
          f"{', '.join(op_names)}", flush=True)

    # Upstream's compiles start first (they take the longest); while they run, only untimed
    # work is done (inputs, our outputs, the float32 reference). All timing comes after them,
    # so compile threads never compete with the host side of a timed loop.
    up, up_note = (None, "upstream skipped (--no-upstream)") if cfg.no_upstream else \
        load_upstream()
    print(up_note, flush=True)
    ops = make_ops(up)
    kinds = upstream_kinds(op_names)
    compile_timeout = cfg.compile_timeout or 240.0 * len(kinds)
    compiler = None
    if up is not None:
        jobs = [(kind, shape) for shape in shapes for kind in kinds]
        workers = cfg.compile_workers or min(len(jobs), os.cpu_count() or 1)
        compiler = Compiler(up, jobs, workers)
        print(f"compiling {len(jobs)} upstream kernels ({', '.join(kinds)}) in {workers} "
              f"threads (cache {os.environ.get('TILELANG_CACHE_DIR')})", flush=True)
    use_ref_timing = up is None

    # ---- phase A (untimed): inputs (shared by the ops), our outputs, the float32 reference
    sets_of = {}
    for shape in shapes:
        sets_of[shape] = [make_inputs(shape, seed) for seed in range(N_COPIES)]
    for name in op_names:
        op = ops[name]
        op.ref_on = cfg.ref and (name == "bwd_fwd" or not cfg.ref_fwd_only)
        op.state = {}
        for shape in shapes:
            N, P, R, C = shape
            sets = sets_of[shape]
            if op.prepare is not None:
                for s in sets:
                    op.prepare(s, shape)
            row = dict(shape=label(shape), N=N, P=P, R=R, C=C, flops=op.flops(shape))
            mine = None
            try:
                mine = tuple(op.ours(sets[0], C))
                sync()
            except Exception as e:  # noqa: BLE001 - e.g. a build without this CUDA backend
                row["ours_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"[{name}] {label(shape)}: ours failed: {row['ours_error']}", flush=True)
            if mine is not None:
                outs = mine
            elif name == "bwd_fwd":
                outs = tuple(sets[0]["up_out"].values())
            elif name == "bwd_bwd":
                outs = tuple(sets[0]["bb_out"].values())
            else:  # the outputs' sizes, from our allocator on the meta device
                s0 = sets[0]
                outs = mimo._cb_alloc(s0["q"], s0["k"], s0["v"], C, RDD, None, True, True, True,
                                      name == "combined_norm", lambda shape_, dt_: torch.empty(
                                          shape_, dtype=dt_, device="meta"))
            row["bytes"] = nbytes([sets[0][k] for k in op.inputs], outs)
            ref = None
            if op.ref_on:
                try:
                    ref = op.ref(sets[0], C)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: no ref columns
                    row["ref_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"[{name}] {label(shape)}: fp32 reference failed: {row['ref_error']}",
                          flush=True)
                    if DEV != "cpu":
                        torch.cuda.empty_cache()
                if mine is not None and ref is not None:
                    row["ours_vs_ref_fp32_rel_l2"] = agree(op.out_names, mine, ref)
            op.state[shape] = (row, mine, ref)
            print(f"[{name}] {label(shape)}: inputs ready" + (
                ", ours vs fp32 reference: " + ", ".join(
                    f"{n} {v:.1e}" for n, v in row["ours_vs_ref_fp32_rel_l2"].items())
                if "ours_vs_ref_fp32_rel_l2" in row else ""), flush=True)

    compile_note = ""
    if compiler is not None:
        left = compile_timeout - (time.perf_counter() - compiler.t0)
        done = compiler.wait(max(0.0, left))
        if done:
            compile_note = (f"upstream compile: {compiler.total_s:.1f} s wall for "
                            f"{len(jobs)} kernels in parallel (per kernel: " + ", ".join(
                                f"{k} {label(s_)} {compiler.seconds.get((k, s_), 0):.0f} s"
                                for k, s_ in jobs) + ")")
        else:
            ready_at_limit = len(compiler.kernels)
            compile_note = late_compile_note(compile_timeout, ready_at_limit, len(jobs))
        print(compile_note, flush=True)
        for (k, s_), e in compiler.errors.items():
            print(f"  upstream compile failed for {k} {label(s_)}: {e}", flush=True)

    # ---- phase B (timed): ceilings once, then per op ours and upstream per shape
    if DEV == "cpu":
        cpm = copy_gbps = copy_ms = mm_tflops = mm_ms = None
    else:
        cpm = _sleep_cycles_per_ms()
        copy_gbps, copy_ms = copy_ceiling_gbps(cfg, cpm)
        mm_tflops, mm_ms = matmul_ceiling_tflops(cfg, cpm)
    if DEV != "cpu":
        print(f"copy ceiling: {copy_gbps:.0f} GB/s (1 GiB device-to-device copy, "
              f"{copy_ms:.3f} ms); bf16 matmul ceiling: {mm_tflops:.0f} TFLOP/s (8192^3, "
              f"{mm_ms:.3f} ms)", flush=True)
    results = {}
    for name in op_names:
        op = ops[name]
        t_op = time.perf_counter()
        ref_timing = use_ref_timing and (name == "bwd_fwd" or not cfg.ref_fwd_only)
        rows = run_op(op, shapes, sets_of, cfg, compiler, ref_timing, cpm, mm_tflops, copy_gbps)
        results[name] = (rows, time.perf_counter() - t_op)
    del sets_of
    if DEV != "cpu":
        torch.cuda.empty_cache()
    if compiler is not None and not done:
        # The compiles left at the limit go on in the background, and a shape is timed against
        # upstream when its kernel is ready by its turn: say how many were, not only how many
        # were ready at the limit (session 40's table had upstream times at 10 shapes under a
        # note that said 7 of 11 kernels).
        compile_note = late_compile_note(compile_timeout, ready_at_limit, len(jobs),
                                         len(compiler.kernels))

    # ------------------------------------------------------------------ report
    total_s = time.perf_counter() - t_start
    texts = []
    out_dir = os.environ.get("OUT")
    for name in op_names:
        op = ops[name]
        rows, op_s = results[name]
        header, agreement, perf, geo, cmp_name = report(
            op, rows, dev_name, copy_gbps, mm_tflops, up_note, compile_note, use_ref_timing,
            op.ref_on)
        perf += f"\n\nTimed phase of this op: {op_s:.0f} s; whole run: {total_s:.0f} s."
        texts.append((header, agreement, perf))
        # The file: header, agreement table (if any), performance table (last).
        text = "\n\n".join(x for x in (header, agreement, perf) if x)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            stem = os.path.join(out_dir, OUT_FILE[name])
            with open(stem + ".json", "w") as f:
                json.dump(dict(op=name, device=dev_name, torch=torch.__version__,
                               library=mamba3_kernels.library_path(),
                               copy_ceiling_gbps=copy_gbps, matmul_ceiling_tflops=mm_tflops,
                               upstream_note=up_note, compile_note=compile_note,
                               geomean_ratio=geo, comparison=cmp_name, ref_fp32=op.ref_on,
                               total_s=total_s, op_s=op_s, rows=rows), f, indent=1)
            with open(stem + ".md", "w") as f:
                f.write(text + "\n")
    # Printed: every agreement table first, then the performance tables (last, so that they are
    # what a truncated log tail keeps).
    for header, agreement, _ in texts:
        if agreement:
            print()
            print(f"{header} (agreement)\n\n{agreement}", flush=True)
    for header, _, perf in texts:
        print()
        print(f"{header}\n\n{perf}", flush=True)
    if compiler is not None and compiler.thread.is_alive():
        # Compile threads that are still running would keep the interpreter from exiting.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
