"""MIMO backward passes of Mamba-3 on torch tensors: the first pass (seed 003; upstream's
mamba_mimo_bwd_fwd) and the second pass (seed 001; upstream's mamba_mimo_bwd_bwd, at the end of
this docstring).

  mamba3_mimo_bwd_fwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev,
                      dt, trap, segsum, mimo_z=None, d=None, z=None, chunk_size=16,
                      rotary_dim_divisor=4, output_dtype=torch.float32, norm_weight=None,
                      norm_eps=1e-5)
      -> (states, qk_dot, dmimo_o, dmimo_z, dz)                       without norm_weight
      -> (states, qk_dot, dmimo_o, dmimo_z, dz, dnorm_weight, dout_pre_rms)  with it

Shapes, dtypes and the model are those of include/mamba3/mamba3.h (mamba3_mimo_bwd_fwd) and
golden/include/mamba3_golden/mimo.hpp:
  dout [B,S,H,P] with mimo_o (reduce-O), [B,S,R,H,P] without (per rank); q, k [B,S,R,G,N];
  v, z [B,S,H,P]; q_bias, k_bias [H,R,N]; mimo_v, mimo_o, mimo_z [H,R,P]; d [H];
  angles [B,S,H,N/rotary_dim_divisor]; da_cs, da_cs_rev, dt, trap [B,H,S];
  segsum [B,H,nchunks,C,C]; norm_weight [H,P] (fused pre-gate RMSNorm; needs mimo_o, z, mimo_z).
  Any float input may be f16, bf16 or f32. S need not be a multiple of chunk_size.
Outputs: states [B,H,nchunks,N,P] (entering each chunk), qk_dot [B,H,S,R,R], dz [B,S,H,P] and
  dout_pre_rms [B,H,S*R,P] in output_dtype (f16, bf16 or f32); dmimo_o, dmimo_z, dnorm_weight
  [B,H,R,P] in f32, per batch (sum over B, and over R for dnorm_weight, to get the parameter
  gradients). dmimo_o is None without mimo_o; dmimo_z and dz are None without z.
  `D` is accepted as a keyword alias of `d` (upstream's spelling).

Behaviour (as siso.py): CUDA tensors run asynchronously on torch.cuda.current_stream() of their
device, CPU tensors on the library's CPU backend; no fallback between them. Inputs whose last
dimension is not unit-stride are copied to contiguous tensors here, other strides are passed as
they are. Bad arguments raise ValueError naming the argument, other failures RuntimeError. The
function is registered as the custom op torch.ops.mamba3.mimo_bwd_fwd (with a fake
implementation; absent outputs come back from the op as 0-element tensors, which the Python
function turns into None), so it traces under torch.compile(fullgraph=True) and can be captured
in CUDA graphs; in eager mode the library is called directly. mamba3_mimo_bwd_fwd_out writes
into caller-given outputs (eager only; the output dtype is the dtype of `states`).

  mamba3_mimo_bwd_bwd(dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev,
                      dt, trap, segsum, angles, mimo_o=None, d=None, chunk_size=16,
                      rotary_dim_divisor=4, output_dtype=None)
      -> {"DQ", "DK", "DV", "DMIMO_V", "DANGLES", "DFACTOR", "DGAMMA", "DDA", "DSSDA",
          "DDA_CS_REV", "DDA_CS", "DD"}

The second pass (include/mamba3/mamba3.h, mamba3_mimo_bwd_bwd; meaning of every output in
golden/include/mamba3_golden/mimo_bwd_bwd.hpp): states [B,H,nchunks,N,P] and qk_dot [B,H,S,R,R]
as the first pass returns them. dout is [B,S,H,P] with mimo_o (reduce-O), [B,S,R,H,P] without
(per rank), or [B,H,S*R,P] without (the packed dout_pre_rms of the fused-norm first pass); no gate
here. Returns DQ, DK [B,S*R,H,N] (per head; sum the heads of a q/k group), DV [B,S,H,P] in
output_dtype (default: the dtype of q, k and v respectively), and in f32 DMIMO_V [B,H,R,P] (per
batch), DANGLES [B,S,H,N/rotary_dim_divisor], DFACTOR, DGAMMA, DDA, DDA_CS_REV, DDA_CS [B,H,S],
DSSDA [B,H,nchunks,C,C], DD [B,H] (per batch; None without d). Registered as
torch.ops.mamba3.mimo_bwd_bwd (12 tensors, DD a 0-element placeholder without d). CPU tensors
run the CPU backend, CUDA tensors the CUDA backend (on torch's current stream, workspace from
torch's allocator).

  mamba3_mimo_bwd_combined(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles,
                           da_cs, da_cs_rev, dt, trap, d, segsum, chunk_size=16,
                           rotary_dim_divisor=4, *, norm_weight=None, norm_eps=1e-5,
                           output_dtype=None)
      -> (dq, dk, dv, dadt, ddt, dtrap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o, dangles,
          dd, dz, dnorm_weight)

The combined backward (upstream's mamba_mimo_bwd_combined, its argument and return order): both
passes and the reductions, gradients of sum(dout * out) w.r.t. the raw inputs (dadt is upstream's
ddA). Registered as torch.ops.mamba3.mimo_bwd_combined; CPU and CUDA tensors (on CUDA the first
pass's intermediates live in a float32 workspace from torch's allocator).
"""
from __future__ import annotations

import ctypes
import operator
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _dlpack, _lib
from ._common import copy_back, rank_error, required, stream_of, unit_stride_outputs, use_direct

__all__ = ["mamba3_mimo_bwd_fwd", "mamba3_mimo_bwd_fwd_out", "mamba3_mimo_bwd_bwd",
           "BWD_BWD_OUTPUTS", "mamba3_mimo_bwd_combined", "COMBINED_OUTPUTS"]

_pack = _dlpack.pack
_f32 = torch.float32
_OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_NAMES = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs",
          "da_cs_rev", "dt", "trap", "segsum", "mimo_z", "d", "z", "norm_weight",
          "states", "qk_dot", "dmimo_o", "dmimo_z", "dz", "dnorm_weight", "dout_pre_rms")
_NIN = 18
_NOUT = 7


class _Fns:
    """ctypes objects of the two MIMO entry points, argtypes declared once."""

    def __init__(self):
        lib = _lib.load()
        try:
            run = lib.lib.mamba3_mimo_bwd_fwd
            ws = lib.lib.mamba3_mimo_bwd_fwd_workspace_size
        except AttributeError as e:
            raise RuntimeError(f"{lib.path} has no mamba3_mimo_bwd_fwd (a library older than "
                               f"the MIMO operators?): {e}") from None
        vp = ctypes.c_void_p
        scalars = [ctypes.c_double, ctypes.c_int64, ctypes.c_int64]  # norm_eps, chunk, divisor
        # 18 inputs, the scalars, 7 outputs, then (size_t*) or (workspace, bytes, stream)
        ws.argtypes = [vp] * _NIN + scalars + [vp] * _NOUT + [ctypes.POINTER(ctypes.c_size_t)]
        ws.restype = ctypes.c_int
        run.argtypes = [vp] * _NIN + scalars + [vp] * _NOUT + [vp, ctypes.c_size_t, vp]
        run.restype = ctypes.c_int
        self.run, self.workspace_size = run, ws


_F = None
_ws_cache = {}


def _fns() -> _Fns:
    global _F
    if _F is None:
        _F = _Fns()
    return _F


def _sizes(q, v, chunk_size):
    """(B, S, R, G, N, H, P, nchunks) from q and v; the library checks everything else."""
    if q is None or v is None:
        required("q", q)
        required("v", v)
    if q.dim() != 5:
        raise rank_error("q", q, "B,S,R,G,N")
    if v.dim() != 4:
        raise rank_error("v", v, "B,S,H,P")
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    # An invalid chunk size is reported by the library; a placeholder keeps the shapes defined.
    nch = -(-S // chunk_size) if chunk_size > 0 else 1
    return B, S, R, G, N, H, P, nch


def _check_output_dtype(output_dtype):
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"output_dtype: {output_dtype} is not supported (expected torch.float16, "
                         "torch.bfloat16 or torch.float32)")


def _alloc(q, v, chunk_size, output_dtype, reduce_o, has_z, has_norm, new):
    """The outputs (None where absent). new(shape, dtype) allocates one tensor."""
    B, S, R, G, N, H, P, nch = _sizes(q, v, chunk_size)
    od = output_dtype
    return (new((B, H, nch, N, P), od), new((B, H, S, R, R), od),
            new((B, H, R, P), _f32) if reduce_o else None,
            new((B, H, R, P), _f32) if has_z else None,
            new((B, S, H, P), od) if has_z else None,
            new((B, H, R, P), _f32) if has_norm else None,
            new((B, H, S * R, P), od) if has_norm else None)


def _workspace(F, ins, outs, norm_eps, chunk_size, rdd, device):
    """Workspace bytes (CUDA only; 0 on the CPU). They depend only on the shapes, dtypes,
    presence of the optional tensors and the scalars, so they are asked once per such key."""
    key = (device, chunk_size, rdd) + tuple(
        None if t is None else (t.shape, t.dtype) for t in ins) + tuple(
        None if t is None else t.dtype for t in outs)
    n = _ws_cache.get(key)
    if n is None:
        buf, a, kept = _pack(tuple(ins) + tuple(outs), _NAMES, _NIN)
        out = ctypes.c_size_t(0)
        # C order: the 18 inputs, the three scalars, the 7 outputs, then the result pointer.
        rc = F.workspace_size(*a[:_NIN], norm_eps, chunk_size, rdd, *a[_NIN:],
                              ctypes.byref(out))
        if rc:
            _lib.raise_status(rc)
        n = out.value
        if len(_ws_cache) > 4096:  # bounded: shapes of a training run are few
            _ws_cache.clear()
        _ws_cache[key] = n
    return n


def _launch(ins, norm_eps, chunk_size, rdd, outs, fresh):
    F = _F or _fns()
    q = ins[1]
    if q is not None and q.is_cuda:
        dev = q.get_device()
        if dev != torch.cuda.current_device():
            with torch.cuda.device(dev):
                return _launch(ins, norm_eps, chunk_size, rdd, outs, fresh)
        stream = stream_of(dev)
        ws_bytes = _workspace(F, ins, outs, norm_eps, chunk_size, rdd, q.device)
    else:
        stream = None
        ws_bytes = 0
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
    buf, a, kept = _pack(ins + tuple(outs), _NAMES, _NIN, fresh)
    rc = F.run(*a[:_NIN], norm_eps, chunk_size, rdd, *a[_NIN:],
               None if ws is None else ws.data_ptr(), ws_bytes, stream)
    if rc:
        _lib.raise_status(rc)


def _functional(ins, norm_eps, chunk_size, rdd, output_dtype):
    q, v = ins[1], ins[3]
    _sizes(q, v, chunk_size)
    dev = q.device
    outs = _alloc(q, v, chunk_size, output_dtype, ins[7] is not None, ins[16] is not None,
                  ins[17] is not None,
                  lambda shape, dtype: torch.empty(shape, dtype=dtype, device=dev))
    _launch(ins, norm_eps, chunk_size, rdd, outs, True)
    return outs


def _placeholders(outs, like):
    """The custom op returns 7 tensors: absent outputs become 0-element f32 tensors."""
    return tuple(like.new_empty((0,), dtype=_f32) if o is None else o for o in outs)


@torch.library.custom_op("mamba3::mimo_bwd_fwd", mutates_args=())
def _op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor, k_bias: Tensor,
        mimo_v: Tensor, mimo_o: Optional[Tensor], angles: Tensor, da_cs: Tensor,
        da_cs_rev: Tensor, dt: Tensor, trap: Tensor, segsum: Tensor, mimo_z: Optional[Tensor],
        d: Optional[Tensor], z: Optional[Tensor], norm_weight: Optional[Tensor], norm_eps: float,
        chunk_size: int, rotary_dim_divisor: int, output_dtype: torch.dtype
        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    ins = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
           segsum, mimo_z, d, z, norm_weight)
    return _placeholders(_functional(ins, norm_eps, chunk_size, rotary_dim_divisor, output_dtype),
                         q)


@_op.register_fake
def _op_fake(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
             segsum, mimo_z, d, z, norm_weight, norm_eps, chunk_size, rotary_dim_divisor,
             output_dtype):
    _check_output_dtype(output_dtype)
    outs = _alloc(q, v, chunk_size, output_dtype, mimo_o is not None, z is not None,
                  norm_weight is not None, lambda shape, dtype: q.new_empty(shape, dtype=dtype))
    return _placeholders(outs, q)


def _d_arg(d, D):
    if D is None:
        return d
    if d is not None:
        raise TypeError("give d or its alias D, not both")
    return D


def _index(x, name):
    if type(x) is int:
        return x
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(x).__name__}") from None


def _result(outs, has_norm):
    return tuple(outs) if has_norm else tuple(outs[:5])


def mamba3_mimo_bwd_fwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor,
                        k_bias: Tensor, mimo_v: Tensor, mimo_o: Optional[Tensor], angles: Tensor,
                        da_cs: Tensor, da_cs_rev: Tensor, dt: Tensor, trap: Tensor,
                        segsum: Tensor, mimo_z: Optional[Tensor] = None,
                        d: Optional[Tensor] = None, z: Optional[Tensor] = None,
                        chunk_size: int = 16, rotary_dim_divisor: int = 4,
                        output_dtype: torch.dtype = torch.float32,
                        norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-5, *,
                        D: Optional[Tensor] = None):
    """The MIMO backward first pass: recomputes the chunked forward and returns (states, qk_dot,
    dmimo_o, dmimo_z, dz), plus (dnorm_weight, dout_pre_rms) when norm_weight is given. All
    gradients are of sum(dout * out). See the module docstring for shapes and dtypes."""
    d = d if D is None else _d_arg(d, D)
    chunk_size = _index(chunk_size, "chunk_size")
    rotary_dim_divisor = _index(rotary_dim_divisor, "rotary_dim_divisor")
    norm_eps = float(norm_eps)
    _check_output_dtype(output_dtype)
    if q is None:
        required("q", q)
    has_norm = norm_weight is not None
    if use_direct(q):
        outs = _functional((dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs,
                            da_cs_rev, dt, trap, segsum, mimo_z, d, z, norm_weight),
                           norm_eps, chunk_size, rotary_dim_divisor, output_dtype)
        return _result(outs, has_norm)
    outs = _op(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
               segsum, mimo_z, d, z, norm_weight, norm_eps, chunk_size, rotary_dim_divisor,
               output_dtype)
    # The op returns placeholders for absent outputs; which ones is known from the arguments.
    present = (True, True, mimo_o is not None, z is not None, z is not None, has_norm, has_norm)
    return _result(tuple(o if p else None for o, p in zip(outs, present)), has_norm)


def mamba3_mimo_bwd_fwd_out(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs,
                            da_cs_rev, dt, trap, segsum, mimo_z=None, d=None, z=None,
                            chunk_size=16, rotary_dim_divisor=4, norm_weight=None, norm_eps=1e-5,
                            *, states, qk_dot, dmimo_o=None, dmimo_z=None, dz=None,
                            dnorm_weight=None, dout_pre_rms=None, D=None):
    """mamba3_mimo_bwd_fwd writing into the given outputs (the output dtype is the dtype of
    states; dmimo_o exactly with mimo_o, dmimo_z and dz exactly with z, dnorm_weight and
    dout_pre_rms exactly with norm_weight; every element is overwritten). Returns the outputs
    as mamba3_mimo_bwd_fwd does."""
    d = _d_arg(d, D)
    required("q", q)
    outs = (states, qk_dot, dmimo_o, dmimo_z, dz, dnorm_weight, dout_pre_rms)
    work = unit_stride_outputs(outs)
    _launch((dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
             segsum, mimo_z, d, z, norm_weight), float(norm_eps),
            _index(chunk_size, "chunk_size"), _index(rotary_dim_divisor, "rotary_dim_divisor"),
            work, False)
    copy_back(outs, work)
    return _result(outs, norm_weight is not None)


# ------------------------------------------------------------------------------ second pass

BWD_BWD_OUTPUTS = ("DQ", "DK", "DV", "DMIMO_V", "DANGLES", "DFACTOR", "DGAMMA", "DDA", "DSSDA",
                   "DDA_CS_REV", "DDA_CS", "DD")
_BB_NAMES = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "states", "qk_dot", "da_cs",
             "da_cs_rev", "dt", "trap", "segsum", "angles", "mimo_o", "d",
             "dq", "dk", "dv", "dmimo_v", "dangles", "dfactor", "dgamma", "dda", "dssda",
             "dda_cs_rev", "dda_cs", "dd")
_BB_NIN = 17
_BB_NOUT = 12


class _BBFns:
    """ctypes objects of the second-pass entry points, argtypes declared once."""

    def __init__(self):
        lib = _lib.load()
        try:
            run = lib.lib.mamba3_mimo_bwd_bwd
            ws = lib.lib.mamba3_mimo_bwd_bwd_workspace_size
        except AttributeError as e:
            raise RuntimeError(f"{lib.path} has no mamba3_mimo_bwd_bwd (a library older than "
                               f"the second MIMO pass?): {e}") from None
        vp = ctypes.c_void_p
        scalars = [ctypes.c_int64, ctypes.c_int64]  # chunk_size, rotary_dim_divisor
        ws.argtypes = ([vp] * _BB_NIN + scalars + [vp] * _BB_NOUT
                       + [ctypes.POINTER(ctypes.c_size_t)])
        ws.restype = ctypes.c_int
        run.argtypes = [vp] * _BB_NIN + scalars + [vp] * _BB_NOUT + [vp, ctypes.c_size_t, vp]
        run.restype = ctypes.c_int
        self.run, self.workspace_size = run, ws


_BB = None


def _bb_fns() -> _BBFns:
    global _BB
    if _BB is None:
        _BB = _BBFns()
    return _BB


def _bb_alloc(q, k, v, chunk_size, rdd, output_dtype, has_d, new):
    """The 12 outputs (DD None without d). new(shape, dtype) allocates one tensor."""
    B, S, R, G, N, H, P, nch = _sizes(q, v, chunk_size)
    C = chunk_size if chunk_size > 0 else 1  # (invalid sizes are reported by the library)
    A = N // rdd if rdd > 0 else 1
    dq_t = output_dtype or q.dtype
    dk_t = output_dtype or k.dtype
    dv_t = output_dtype or v.dtype
    return (new((B, S * R, H, N), dq_t), new((B, S * R, H, N), dk_t), new((B, S, H, P), dv_t),
            new((B, H, R, P), _f32), new((B, S, H, A), _f32), new((B, H, S), _f32),
            new((B, H, S), _f32), new((B, H, S), _f32), new((B, H, nch, C, C), _f32),
            new((B, H, S), _f32), new((B, H, S), _f32),
            new((B, H), _f32) if has_d else None)


def _bb_launch(ins, chunk_size, rdd, outs):
    F = _BB or _bb_fns()
    q = ins[1]
    stream, ws, ws_bytes = None, None, 0
    if q is not None and q.is_cuda:
        # The CUDA backend on torch's current stream; its workspace from torch's allocator (so
        # the call is capturable in a CUDA graph).
        dev = q.get_device()
        if dev != torch.cuda.current_device():
            with torch.cuda.device(dev):
                return _bb_launch(ins, chunk_size, rdd, outs)
        stream = stream_of(dev)
        buf, a, kept = _pack(tuple(ins) + tuple(outs), _BB_NAMES, _BB_NIN, True)
        n = ctypes.c_size_t(0)
        rc = F.workspace_size(*a[:_BB_NIN], chunk_size, rdd, *a[_BB_NIN:], ctypes.byref(n))
        if rc:
            _lib.raise_status(rc)
        ws_bytes = n.value
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
    buf, a, kept = _pack(tuple(ins) + tuple(outs), _BB_NAMES, _BB_NIN, True)
    rc = F.run(*a[:_BB_NIN], chunk_size, rdd, *a[_BB_NIN:],
               None if ws is None else ws.data_ptr(), ws_bytes, stream)
    if rc:
        _lib.raise_status(rc)


def _bb_functional(ins, chunk_size, rdd, output_dtype):
    q, k, v = ins[1], ins[2], ins[3]
    _sizes(q, v, chunk_size)
    required("k", k)
    dev = q.device
    outs = _bb_alloc(q, k, v, chunk_size, rdd, output_dtype, ins[16] is not None,
                     lambda shape, dtype: torch.empty(shape, dtype=dtype, device=dev))
    _bb_launch(ins, chunk_size, rdd, outs)
    return outs


@torch.library.custom_op("mamba3::mimo_bwd_bwd", mutates_args=())
def _bb_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor, k_bias: Tensor,
           mimo_v: Tensor, states: Tensor, qk_dot: Tensor, da_cs: Tensor, da_cs_rev: Tensor,
           dt: Tensor, trap: Tensor, segsum: Tensor, angles: Tensor, mimo_o: Optional[Tensor],
           d: Optional[Tensor], chunk_size: int, rotary_dim_divisor: int,
           output_dtype: Optional[torch.dtype]
           ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                      Tensor, Tensor, Tensor]:
    ins = (dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt, trap,
           segsum, angles, mimo_o, d)
    return _placeholders(_bb_functional(ins, chunk_size, rotary_dim_divisor, output_dtype), q)


@_bb_op.register_fake
def _bb_op_fake(dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt,
                trap, segsum, angles, mimo_o, d, chunk_size, rotary_dim_divisor, output_dtype):
    if output_dtype is not None:
        _check_output_dtype(output_dtype)
    outs = _bb_alloc(q, k, v, chunk_size, rotary_dim_divisor, output_dtype, d is not None,
                     lambda shape, dtype: q.new_empty(shape, dtype=dtype))
    return _placeholders(outs, q)


def mamba3_mimo_bwd_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor,
                        k_bias: Tensor, mimo_v: Tensor, states: Tensor, qk_dot: Tensor,
                        da_cs: Tensor, da_cs_rev: Tensor, dt: Tensor, trap: Tensor,
                        segsum: Tensor, angles: Tensor, mimo_o: Optional[Tensor] = None,
                        d: Optional[Tensor] = None, chunk_size: int = 16,
                        rotary_dim_divisor: int = 4, output_dtype: Optional[torch.dtype] = None,
                        *, D: Optional[Tensor] = None):
    """The MIMO backward second pass: returns a dict over BWD_BWD_OUTPUTS (DD None without d).
    See the module docstring for shapes, dtypes and the three dout layouts."""
    d = d if D is None else _d_arg(d, D)
    chunk_size = _index(chunk_size, "chunk_size")
    rotary_dim_divisor = _index(rotary_dim_divisor, "rotary_dim_divisor")
    if output_dtype is not None:
        _check_output_dtype(output_dtype)
    required("q", q)
    ins = (dout, q, k, v, q_bias, k_bias, mimo_v, states, qk_dot, da_cs, da_cs_rev, dt, trap,
           segsum, angles, mimo_o, d)
    if use_direct(q):
        outs = _bb_functional(ins, chunk_size, rotary_dim_divisor, output_dtype)
    else:
        outs = _bb_op(*ins, chunk_size, rotary_dim_divisor, output_dtype)
        outs = tuple(outs[:11]) + (outs[11] if d is not None else None,)
    return dict(zip(BWD_BWD_OUTPUTS, outs))


# ------------------------------------------------------------------------------ combined

COMBINED_OUTPUTS = ("dq", "dk", "dv", "dadt", "ddt", "dtrap", "dq_bias", "dk_bias", "dmimo_v",
                    "dmimo_z", "dmimo_o", "dangles", "dd", "dz", "dnorm_weight")
_CB_NAMES = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "z", "mimo_z",
             "angles", "da_cs", "da_cs_rev", "dt", "trap", "d", "segsum", "norm_weight"
             ) + COMBINED_OUTPUTS
_CB_NIN = 18  # (norm_weight travels with the inputs in the packed buffer)
_CB_NOUT = 15


class _CBFns:
    def __init__(self):
        lib = _lib.load()
        try:
            run = lib.lib.mamba3_mimo_bwd_combined
            ws = lib.lib.mamba3_mimo_bwd_combined_workspace_size
        except AttributeError as e:
            raise RuntimeError(f"{lib.path} has no mamba3_mimo_bwd_combined: {e}") from None
        vp = ctypes.c_void_p
        # 17 inputs, chunk_size, rotary_dim_divisor, norm_weight, norm_eps, 15 outputs, then
        # workspace, bytes, stream (run) or the result pointer (workspace size)
        head = [vp] * 17 + [ctypes.c_int64, ctypes.c_int64, vp, ctypes.c_double]
        run.argtypes = head + [vp] * _CB_NOUT + [vp, ctypes.c_size_t, vp]
        run.restype = ctypes.c_int
        ws.argtypes = head + [vp] * _CB_NOUT + [ctypes.POINTER(ctypes.c_size_t)]
        ws.restype = ctypes.c_int
        self.run, self.workspace_size = run, ws


_CB = None


def _cb_alloc(q, k, v, chunk_size, rdd, output_dtype, has_o, has_z, has_d, has_norm, new):
    B, S, R, G, N, H, P, nch = _sizes(q, v, chunk_size)
    A = N // rdd if rdd > 0 else 1
    f = _f32
    return (new((B, S, R, G, N), output_dtype or q.dtype),
            new((B, S, R, G, N), output_dtype or k.dtype),
            new((B, S, H, P), output_dtype or v.dtype),
            new((B, H, S), f), new((B, H, S), f), new((B, H, S), f),
            new((H, R, N), f), new((H, R, N), f), new((H, R, P), f),
            new((H, R, P), f) if has_z else None,
            new((H, R, P), f) if has_o else None,
            new((B, S, H, A), f),
            new((H,), f) if has_d else None,
            new((B, S, H, P), output_dtype or v.dtype) if has_z else None,
            new((H, P), f) if has_norm else None)


def _cb_functional(ins, norm_eps, chunk_size, rdd, output_dtype):
    global _CB
    q, k, v = ins[1], ins[2], ins[3]
    _sizes(q, v, chunk_size)
    required("k", k)
    dev = q.device
    outs = _cb_alloc(q, k, v, chunk_size, rdd, output_dtype, ins[7] is not None,
                     ins[8] is not None, ins[15] is not None, ins[17] is not None,
                     lambda shape, dtype: torch.empty(shape, dtype=dtype, device=dev))
    F = _CB or _CBFns()
    _CB = F
    _cb_launch(F, ins, norm_eps, chunk_size, rdd, outs)
    return outs


def _cb_launch(F, ins, norm_eps, chunk_size, rdd, outs):
    q = ins[1]
    stream, ws, ws_bytes = None, None, 0
    buf, a, kept = _pack(tuple(ins) + tuple(outs), _CB_NAMES, _CB_NIN, True)
    if q.is_cuda:
        # torch's current stream of q's device; the workspace from torch's allocator (so the
        # call is capturable in a CUDA graph). The CPU backend needs none.
        dev = q.get_device()
        if dev != torch.cuda.current_device():
            with torch.cuda.device(dev):
                return _cb_launch(F, ins, norm_eps, chunk_size, rdd, outs)
        stream = stream_of(dev)
        n = ctypes.c_size_t(0)
        rc = F.workspace_size(*a[:17], chunk_size, rdd, a[17], norm_eps, *a[_CB_NIN:],
                              ctypes.byref(n))
        if rc:
            _lib.raise_status(rc)
        ws_bytes = n.value
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
    rc = F.run(*a[:17], chunk_size, rdd, a[17], norm_eps, *a[_CB_NIN:],
               None if ws is None else ws.data_ptr(), ws_bytes, stream)
    if rc:
        _lib.raise_status(rc)


@torch.library.custom_op("mamba3::mimo_bwd_combined", mutates_args=())
def _cb_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor, k_bias: Tensor,
           mimo_v: Tensor, mimo_o: Optional[Tensor], z: Optional[Tensor],
           mimo_z: Optional[Tensor], angles: Tensor, da_cs: Tensor, da_cs_rev: Tensor,
           dt: Tensor, trap: Tensor, d: Optional[Tensor], segsum: Tensor, chunk_size: int,
           rotary_dim_divisor: int, norm_weight: Optional[Tensor], norm_eps: float,
           output_dtype: Optional[torch.dtype]
           ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                      Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    ins = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, da_cs, da_cs_rev,
           dt, trap, d, segsum, norm_weight)
    return _placeholders(_cb_functional(ins, norm_eps, chunk_size, rotary_dim_divisor,
                                        output_dtype), q)


@_cb_op.register_fake
def _cb_op_fake(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, da_cs,
                da_cs_rev, dt, trap, d, segsum, chunk_size, rotary_dim_divisor, norm_weight,
                norm_eps, output_dtype):
    if output_dtype is not None:
        _check_output_dtype(output_dtype)
    outs = _cb_alloc(q, k, v, chunk_size, rotary_dim_divisor, output_dtype, mimo_o is not None,
                     z is not None, d is not None, norm_weight is not None,
                     lambda shape, dtype: q.new_empty(shape, dtype=dtype))
    return _placeholders(outs, q)


def mamba3_mimo_bwd_combined(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, q_bias: Tensor,
                             k_bias: Tensor, mimo_v: Tensor, mimo_o: Optional[Tensor],
                             z: Optional[Tensor], mimo_z: Optional[Tensor], angles: Tensor,
                             da_cs: Tensor, da_cs_rev: Tensor, dt: Tensor, trap: Tensor,
                             d: Optional[Tensor], segsum: Tensor, chunk_size: int = 16,
                             rotary_dim_divisor: int = 4, *,
                             norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-5,
                             output_dtype: Optional[torch.dtype] = None,
                             D: Optional[Tensor] = None):
    """The combined MIMO backward (upstream's mamba_mimo_bwd_combined, argument and return
    order included): (dq, dk, dv, dadt, ddt, dtrap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o,
    dangles, dd, dz, dnorm_weight), None where the input is absent. dq, dk [B,S,R,G,N], dv and dz
    in output_dtype (default: the dtype of q, k, v, v); the rest f32 (shapes:
    include/mamba3/mamba3.h). norm_weight selects the fused pre-gate RMSNorm (upstream's
    fuse_pregate_headwise_rms_norm with outproj_norm_weight). CPU or CUDA tensors."""
    d = d if D is None else _d_arg(d, D)
    chunk_size = _index(chunk_size, "chunk_size")
    rotary_dim_divisor = _index(rotary_dim_divisor, "rotary_dim_divisor")
    norm_eps = float(norm_eps)
    if output_dtype is not None:
        _check_output_dtype(output_dtype)
    required("q", q)
    ins = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, da_cs, da_cs_rev,
           dt, trap, d, segsum, norm_weight)
    if use_direct(q):
        return tuple(_cb_functional(ins, norm_eps, chunk_size, rotary_dim_divisor, output_dtype))
    outs = _cb_op(*ins[:17], chunk_size, rotary_dim_divisor, norm_weight, norm_eps, output_dtype)
    present = (True,) * 9 + (z is not None, mimo_o is not None, True, d is not None,
                             z is not None, norm_weight is not None)
    return tuple(o if p else None for o, p in zip(outs, present))
