#!/usr/bin/env python3
"""Benchmark of the SISO backward operators (compute_dqktheta, compute_ddt_dtrap_dinput_states)
against upstream mamba_ssm's Triton kernels, in one process on one GPU.

Measured per operator and shape:
- GPU time: median over trials of (CUDA-event time around `reps` back-to-back calls) / reps. Each
  trial first enqueues a GPU sleep long enough for the host to enqueue all `reps` calls, so the
  kernels run back to back without host gaps and the events measure device time only. Inputs
  rotate among 3 independent copies (so that inputs that fit in L2, as the ddt operator's do, are
  not served from L2 by the previous call), and so do the outputs: each call's outputs are kept
  until the call three later (otherwise the caching allocator gives every call the same output
  memory, whose lines the previous call left in L2, and small shapes' writes never reach DRAM:
  in session 37 a load-policy change measured 12-16% faster that way and 2% faster to 4% slower
  with rotating outputs; docs/PERF.md).
- End-to-end time: wall clock per call through the Python function, median over batches of
  `reps` calls, with a device synchronisation at the end of each batch (host overhead included).
- Bytes: every input read once plus every output written once; achieved bandwidth as a fraction
  of the copy ceiling (a large device-to-device copy, bytes read + written over median time,
  measured in the same run).
- Upstream: mamba_ssm.ops.triton.mamba3.mamba3_siso_bwd, imported from the git-ignored folder
  .upstream/ (never part of this repository), run on the same inputs; its Python function is
  timed as it is (including its own torch.sum/reductions), after warm-up and autotuning. If the
  import fails the table says so and the run continues. Our outputs are compared with upstream's
  (rel_l2; upstream uses approximate sin/cos, so differences around 1e-3 are expected).

Prints a Markdown table last; with $OUT set, also writes $OUT/bench_siso_bwd.{json,md}.
Usage: python bench/bench_siso_bwd.py [--quick] [--no-upstream] [--shapes 0,2]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types

# Cache upstream's autotuning results with Triton's compiled kernels (same choice, made once).
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    from mamba3_kernels import siso
except ImportError:  # running from a source checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(REPO, "python"))
    from mamba3_kernels import siso
import mamba3_kernels  # noqa: E402

DEV = "cuda"
BF16, F32 = torch.bfloat16, torch.float32

SHAPES = [
    # name, B, S, H, G, N, A (P = 64 for the state variant of the ddt operator)
    ("B4 S2048 H32 G1 N128 A32", 4, 2048, 32, 1, 128, 32),
    ("B8 S4096 H32 G1 N128 A32", 8, 4096, 32, 1, 128, 32),
    ("GQA B2 S2048 H16 G4 N64 A16", 2, 2048, 16, 4, 64, 16),
]
P_STATE = 64
N_COPIES = 3


# ----------------------------------------------------------------------------- upstream

def load_upstream():
    """Returns (module, note). module is None when the import fails; note says why or what was
    done to import it."""
    note = ""
    up_dir = os.path.join(REPO, ".upstream")
    if not os.path.isdir(up_dir):
        return None, f"upstream not available: {up_dir} does not exist"
    sys.path.insert(0, up_dir)
    try:
        import einops  # noqa: F401
    except ImportError:
        # The upstream module imports einops at the top but the two functions measured here do
        # not use it; a stub that fails loudly if called lets the module import.
        stub = types.ModuleType("einops")

        def _unavailable(*a, **k):
            raise RuntimeError("einops is not installed (stub for the benchmark)")
        stub.rearrange = stub.repeat = _unavailable
        sys.modules["einops"] = stub
        note = "einops not installed: stubbed (unused by the measured functions)"
    try:
        from mamba_ssm.ops.triton.mamba3 import mamba3_siso_bwd as up
    except Exception as e:  # noqa: BLE001 - any failure is reported and the run goes on
        return None, f"upstream import failed: {type(e).__name__}: {e}"
    return up, note


# ----------------------------------------------------------------------------- inputs

def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, device=DEV, generator=gen) * scale).to(dtype)


def _rand(shape, dtype, gen, lo, hi):
    return (torch.rand(shape, device=DEV, generator=gen) * (hi - lo) + lo).to(dtype)


def dqktheta_inputs(B, S, H, G, N, A, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return dict(q=_randn((B, S, G, N), BF16, g), k=_randn((B, S, G, N), BF16, g),
                scale=_rand((B, H, S), F32, g, 0.05, 0.55),
                gamma=_rand((B, H, S), F32, g, 0.05, 0.55),
                q_bias=_randn((H, N), BF16, g, 0.5), k_bias=_randn((H, N), BF16, g, 0.5),
                angles=_rand((B, S, H, A), F32, g, 0.0, 2 * math.pi),
                dq_in=_randn((B, S, H, N), BF16, g), dk_in=_randn((B, S, H, N), BF16, g),
                dqk=_randn((B, H, S), F32, g))


def ddt_inputs(B, S, H, N, P, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    d = dict(dscale=_randn((B, H, S), F32, g), dgamma=_randn((B, H, S), F32, g),
             dt=_rand((B, H, S), F32, g, 0.01, 0.51), trap=_randn((B, H, S), F32, g, 2.0))
    if P:
        d.update(d_issm_state=_randn((B, H, P, N), F32, g),
                 input_k_state=_randn((B, H, N), F32, g),
                 input_v_state=_randn((B, H, P), F32, g))
    return d


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ----------------------------------------------------------------------------- timing

def _sleep_cycles_per_ms():
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles // 10)  # warm
    s.record()
    torch.cuda._sleep(cycles)
    e.record()
    e.synchronize()
    return cycles / s.elapsed_time(e)


def gpu_time_ms(fn, sets, reps, trials, cycles_per_ms, host_ms):
    """Median device time per call of fn(set) over trials of `reps` back-to-back calls."""
    sleep_ms = min(200.0, 2.0 * reps * host_ms + 0.2)
    times = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        s.record()
        for i in range(reps):
            fn(sets[i % len(sets)])
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps)
    return statistics.median(times)


def e2e_time_ms(fn, sets, reps, batches):
    """Median wall-clock time per call over batches of `reps` calls, synchronising after each."""
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(reps):
            fn(sets[i % len(sets)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


def host_time_ms(fn, sets, reps=20):
    """Wall time per call of enqueueing only (no synchronisation inside the loop)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(reps):
        fn(sets[i % len(sets)])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / reps


def copy_ceiling_gbps(cfg, cycles_per_ms):
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = gpu_time_ms(lambda _: b.copy_(a), [None], cfg.reps, cfg.trials, cycles_per_ms, 0.05)
    del a, b
    return 2 * n / (ms * 1e-3) / 1e9, ms


def keeping_outputs(fn, n):
    """fn, with each call's result kept alive until n calls later (outputs rotate among n + 1
    buffers instead of reusing one)."""
    ring, calls = [None] * n, [0]

    def kept(s):
        out = fn(s)
        ring[calls[0] % n] = out
        calls[0] += 1
        return out
    return kept


def measure(fn, sets, cfg, cycles_per_ms):
    fn = keeping_outputs(fn, len(sets))
    for i in range(cfg.warmup):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    host = host_time_ms(fn, sets)
    gpu = gpu_time_ms(fn, sets, cfg.reps, cfg.trials, cycles_per_ms, host)
    e2e = e2e_time_ms(fn, sets, cfg.reps, cfg.batches)
    return dict(gpu_ms=gpu, e2e_ms=e2e, host_enqueue_ms=host)


def rel_l2(a, b):
    """||a - b|| / ||b|| in float64 (b: upstream's output)."""
    a, b = a.double(), b.double()
    num = torch.linalg.vector_norm(a - b).item()
    den = torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ----------------------------------------------------------------------------- main

DQK_ORDER = ("q", "k", "scale", "gamma", "q_bias", "k_bias", "angles", "dq_in", "dk_in", "dqk")
DDT_ORDER = ("dscale", "dgamma", "dt", "trap", "d_issm_state", "input_k_state", "input_v_state")
DQK_OUT = ("dq", "dk", "dq_bias", "dk_bias", "dangles", "dscale", "dgamma")
DDT_OUT = ("ddt", "dtrap", "d_input_ssm_state", "d_input_k_state", "d_input_v_state")


def bench_case(label, op, sets, ours_fn, up_fn, out_names, cfg, cpm, rows, agreement):
    ours_out = ours_fn(sets[0])
    torch.cuda.synchronize()
    in_bytes = nbytes(sets[0].values())
    total = in_bytes + nbytes(ours_out)
    row = dict(shape=label, op=op, bytes=total)
    row["ours"] = measure(ours_fn, sets, cfg, cpm)
    row["ours_custom_op_e2e_ms"] = None
    if cfg.custom_op:
        op_fn = _custom_op_fn(op)
        if op_fn is not None:
            op_fn(sets[0])
            row["ours_custom_op_e2e_ms"] = e2e_time_ms(op_fn, sets, cfg.reps, cfg.batches)
    row["upstream"] = None
    if up_fn is not None:
        try:
            t0 = time.perf_counter()
            up_out = up_fn(sets[0])  # also triggers autotuning
            torch.cuda.synchronize()
            row["upstream_first_call_s"] = time.perf_counter() - t0
            row["upstream"] = measure(up_fn, sets, cfg, cpm)
            agreement.append(dict(shape=label, op=op, rel_l2={
                n: rel_l2(a, b) for n, a, b in zip(out_names, ours_out, up_out)
                if a is not None and b is not None}))
        except Exception as e:  # noqa: BLE001
            row["upstream_error"] = f"{type(e).__name__}: {e}"
    rows.append(row)
    o = row["ours"]
    print(f"  {op:<38} ours gpu {o['gpu_ms']:.4f} ms e2e {o['e2e_ms']:.4f} ms"
          + (f" | upstream gpu {row['upstream']['gpu_ms']:.4f} ms e2e "
             f"{row['upstream']['e2e_ms']:.4f} ms (first call incl. autotune "
             f"{row['upstream_first_call_s']:.1f} s)" if row["upstream"] else ""), flush=True)


def _custom_op_fn(op):
    if op == "compute_dqktheta":
        return lambda s: torch.ops.mamba3.compute_dqktheta(*(s[k] for k in DQK_ORDER), None,
                                                           64, None)
    if op == "compute_ddt_dtrap":
        return lambda s: torch.ops.mamba3.compute_ddt_dtrap(
            s["dscale"], s["dgamma"], s["dt"], s["trap"], None, None, None)
    if op.startswith("compute_ddt_dtrap_dinput_states"):
        return lambda s: torch.ops.mamba3.compute_ddt_dtrap_dinput_states(
            *(s[k] for k in DDT_ORDER), None)
    return None


def fmt(x, nd=4):
    return "n/a" if x is None else f"{x:.{nd}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--no-custom-op", dest="custom_op", action="store_false",
                    help="skip the e2e timing through torch.ops.mamba3 (custom-op dispatch)")
    ap.add_argument("--shapes", default="", help="comma-separated indices into the shape list")
    cfg = ap.parse_args()
    cfg.reps, cfg.trials, cfg.batches, cfg.warmup = (10, 5, 3, 3) if cfg.quick else (30, 15, 7, 5)

    torch.backends.cuda.matmul.allow_tf32 = False
    dev_name = torch.cuda.get_device_name()
    print(f"device: {dev_name}; torch {torch.__version__}; library "
          f"{mamba3_kernels.library_path()} (cuda={mamba3_kernels.has_cuda()}); binding "
          f"{mamba3_kernels.binding()}", flush=True)
    cpm = _sleep_cycles_per_ms()
    ceiling, copy_ms = copy_ceiling_gbps(cfg, cpm)
    print(f"copy ceiling: {ceiling:.0f} GB/s (1 GiB device-to-device copy, {copy_ms:.3f} ms)",
          flush=True)

    up, up_note = (None, "upstream skipped (--no-upstream)") if cfg.no_upstream else \
        load_upstream()
    if up_note:
        print(up_note, flush=True)

    shapes = SHAPES
    if cfg.shapes:
        shapes = [SHAPES[int(i)] for i in cfg.shapes.split(",")]
    rows, agreement = [], []
    for label, B, S, H, G, N, A in shapes:
        print(f"{label}:", flush=True)
        sets = [dqktheta_inputs(B, S, H, G, N, A, seed) for seed in range(N_COPIES)]
        ours = lambda s: siso.compute_dqktheta(*(s[k] for k in DQK_ORDER))  # noqa: E731
        upf = None if up is None else (
            lambda s: up.compute_dqktheta(*(s[k] for k in DQK_ORDER)))
        bench_case(label, "compute_dqktheta", sets, ours, upf, DQK_OUT, cfg, cpm, rows,
                   agreement)
        del sets
        for P in (0, P_STATE):
            sets = [ddt_inputs(B, S, H, N, P, seed) for seed in range(N_COPIES)]
            ours = lambda s: siso.compute_ddt_dtrap_dinput_states(  # noqa: E731
                *(s.get(k) for k in DDT_ORDER))
            upf = None if up is None else (
                lambda s: up.compute_ddt_dtrap_dinput_states(*(s.get(k) for k in DDT_ORDER)))
            name = "compute_ddt_dtrap" if not P else f"compute_ddt_dtrap_dinput_states P={P}"
            bench_case(label, name, sets, ours, upf, DDT_OUT, cfg, cpm, rows, agreement)
            del sets
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ report
    lines = []
    if agreement:
        lines += ["Agreement with upstream (rel_l2 of our outputs vs upstream's):", "",
                  "| shape | op | rel_l2 per output |", "|---|---|---|"]
        for a in agreement:
            lines.append(f"| {a['shape']} | {a['op']} | " + ", ".join(
                f"{k} {v:.1e}" for k, v in a["rel_l2"].items()) + " |")
        lines.append("")
    if cfg.custom_op:
        lines += ["End-to-end through the custom op (torch.ops.mamba3) vs the eager fast path:",
                  "", "| shape | op | fast path e2e ms | custom op e2e ms |", "|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['shape']} | {r['op']} | {fmt(r['ours']['e2e_ms'])} | "
                         f"{fmt(r['ours_custom_op_e2e_ms'])} |")
        lines.append("")
    lines += [f"Device {dev_name}; copy ceiling {ceiling:.0f} GB/s. Ratios are upstream / ours "
              "(> 1: ours faster)." + (f" Upstream: {up_note}." if up_note else ""), "",
              "| shape | op | ours GPU ms | upstream GPU ms | ratio | ours e2e ms | "
              "upstream e2e ms | e2e ratio | bytes (MB) | % of copy ceiling |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, u = r["ours"], r["upstream"]
        pct = r["bytes"] / (o["gpu_ms"] * 1e-3) / 1e9 / ceiling * 100
        r["pct_of_copy_ceiling"] = pct
        if u:
            r["gpu_ratio"] = u["gpu_ms"] / o["gpu_ms"]
            r["e2e_ratio"] = u["e2e_ms"] / o["e2e_ms"]
            r["upstream_pct_of_copy_ceiling"] = r["bytes"] / (u["gpu_ms"] * 1e-3) / 1e9 / \
                ceiling * 100
        up_gpu = fmt(u["gpu_ms"]) if u else r.get("upstream_error", "n/a")[:40]
        lines.append(
            f"| {r['shape']} | {r['op']} | {fmt(o['gpu_ms'])} | {up_gpu} | "
            f"{fmt(r.get('gpu_ratio'), 2)} | {fmt(o['e2e_ms'])} | "
            f"{fmt(u['e2e_ms']) if u else 'n/a'} | {fmt(r.get('e2e_ratio'), 2)} | "
            f"{r['bytes'] / 1e6:.1f} | {pct:.1f} |")
    text = "\n".join(lines)
    print()
    print(text, flush=True)

    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_siso_bwd.json"), "w") as f:
            json.dump(dict(device=dev_name, torch=torch.__version__,
                           library=mamba3_kernels.library_path(),
                           binding=mamba3_kernels.binding(), copy_ceiling_gbps=ceiling,
                           upstream_note=up_note, rows=rows, agreement=agreement), f, indent=1)
        with open(os.path.join(out_dir, "bench_siso_bwd.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
