"""SISO backward operators of Mamba-3 (seed 000) on torch tensors.

Public functions (argument order, shapes and return order as upstream mamba_ssm):

  compute_dqktheta(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                   d_ok_state=None, chunk_size=64, cu_seqlens=None)
      -> (dq, dk, dq_bias, dk_bias, dangles, dscale, dgamma)
  compute_ddt_dtrap_dinput_states(dscale, dgamma, dt, trap, d_issm_state=None,
                                  input_k_state=None, input_v_state=None, cu_seqlens=None)
      -> (ddt, dtrap, d_input_ssm_state, d_input_k_state, d_input_v_state)

Shapes and dtypes are those of include/mamba3/mamba3.h. Upstream spells the varlen argument
`Cu_Seqlens`; it is accepted as a keyword alias. The state outputs are None without d_issm_state.

Behaviour shared by all entry points:
- CUDA tensors run on torch.cuda.current_stream() of their device, asynchronously, like any torch
  op; CPU tensors run on the library's CPU backend, synchronously. All tensors of one call must be
  on one device (the library refuses mixed devices; it never moves data or falls back).
- An input whose last dimension is not unit-stride (e.g. a transposed view) is first copied to a
  contiguous tensor here; other strided views (slices along outer dimensions) are passed to the
  library as they are.
- Bad arguments raise ValueError whose message starts with the argument's name; other failures
  raise RuntimeError carrying the library's message.
- The functional entry points are registered as torch.library custom ops (namespace `mamba3`,
  with fake implementations), so they trace under torch.compile(fullgraph=True) and can be
  captured in CUDA graphs. In eager mode they call the library directly instead of going through
  the custom-op dispatcher, whose per-call cost is of the order of the smaller kernel's run time;
  under torch.compile (torch.compiler.is_compiling()), for tensor subclasses (FakeTensor,
  FunctionalTensor, ...), meta tensors or an active dispatch mode, the custom op is used.
- The functional entry points (eager and inside the custom ops) run through the compiled binding
  mamba3_kernels._C when it is built (mamba3_kernels.binding() == "compiled", see _ext.py), else
  through ctypes; both do the same checks and library calls and give identical results.
- The *_out variants write into caller-given outputs (eager only; outputs whose last dimension is
  not unit-stride are computed into a temporary and copied back).
"""
from __future__ import annotations

import ctypes
import operator
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _dlpack, _ext, _lib
from ._common import copy_back as _copy_back
from ._common import rank_error as _rank_error
from ._common import required as _required
from ._common import stream_of as _stream_of
from ._common import unit_stride_outputs as _unit_stride_outputs
from ._common import use_direct as _use_direct

__all__ = [
    "compute_dqktheta",
    "compute_dqktheta_out",
    "compute_ddt_dtrap_dinput_states",
    "compute_ddt_dtrap_dinput_states_out",
]

_F = None  # the library's function table, loaded on first use
_pack = _dlpack.pack
_f32 = torch.float32


def _fns():
    global _F
    if _F is None:
        _F = _lib.load()
    return _F


# The compiled binding mamba3_kernels._C (see _ext.py), resolved on the first call: the functional
# paths below call it when it is there and the ctypes code of this module otherwise. Both run the
# same checks and the same library calls and give identical results.
_C = None
_C_RESOLVED = False


def _compiled():
    global _C, _C_RESOLVED
    if not _C_RESOLVED:
        _C = _ext.load()
        _C_RESOLVED = True
    return _C


def _cu_arg(cu_seqlens, Cu_Seqlens):
    if Cu_Seqlens is None:
        return cu_seqlens
    if cu_seqlens is not None:
        raise TypeError("give cu_seqlens or its alias Cu_Seqlens, not both")
    return Cu_Seqlens


# ------------------------------------------------------------------------- compute_dqktheta

_DQK_NAMES = ("q", "k", "scale", "gamma", "q_bias", "k_bias", "angles", "dq_in", "dk_in", "dqk",
              "d_ok_state", "cu_seqlens",
              "dq", "dk", "dq_bias", "dk_bias", "dangles", "dscale", "dgamma")
_DQK_NIN = 12
_ws_cache = {}


def _dqktheta_sizes(q, scale, angles):
    if q is None or scale is None or angles is None:
        for name, t in (("q", q), ("scale", scale), ("angles", angles)):
            _required(name, t)
    if q.dim() != 4:
        raise _rank_error("q", q, "B,S,G,N")
    if scale.dim() != 3:
        raise _rank_error("scale", scale, "B,H,S")
    if angles.dim() != 4:
        raise _rank_error("angles", angles, "B,S,H,A")
    B, S, G, N = q.shape
    return B, S, G, N, scale.shape[1], angles.shape[3]


def _dqktheta_alloc(q, scale, gamma, angles, dq_in):
    B, S, G, N, H, A = _dqktheta_sizes(q, scale, angles)
    if gamma is None or dq_in is None:
        _required("gamma", gamma)
        _required("dq_in", dq_in)
    # new_empty: cheaper than torch.empty(..., device=) on the eager hot path
    io = dq_in.dtype
    return (q.new_empty((B, S, G, N), dtype=io),
            q.new_empty((B, S, G, N), dtype=io),
            q.new_empty((H, N), dtype=_f32),
            q.new_empty((H, N), dtype=_f32),
            q.new_empty((B, S, H, A), dtype=angles.dtype),
            q.new_empty((B, H, S), dtype=scale.dtype),
            q.new_empty((B, H, S), dtype=gamma.dtype))


def _dqktheta_workspace(F, q, scale, chunk_size, cu_seqlens):
    """Workspace bytes for this problem. The size depends only on shapes, dtypes, chunk size and
    device, so it is asked from the library once per such key."""
    key = (q.shape, q.dtype, scale.shape, q.device, chunk_size,
           None if cu_seqlens is None else (cu_seqlens.shape, cu_seqlens.dtype))
    n = _ws_cache.get(key)
    if n is None:
        buf, a, kept = _pack((q, scale, cu_seqlens), ("q", "scale", "cu_seqlens"), 0)
        out = ctypes.c_size_t(0)
        rc = F.dqktheta_workspace_size(a[0], a[1], chunk_size, a[2], ctypes.byref(out))
        if rc:
            _lib.raise_status(rc)
        n = out.value
        if len(_ws_cache) > 4096:  # bounded: shapes of a training run are few
            _ws_cache.clear()
        _ws_cache[key] = n
    return n


def _dqktheta_launch(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk, d_ok_state,
                     chunk_size, cu_seqlens, outs, fresh):
    F = _F or _fns()
    if q.is_cuda:
        dev = q.get_device()
        if dev != torch.cuda.current_device():
            with torch.cuda.device(dev):
                return _dqktheta_launch(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in,
                                        dqk, d_ok_state, chunk_size, cu_seqlens, outs, fresh)
        stream = _stream_of(dev)
    else:
        stream = None
    ws_bytes = _dqktheta_workspace(F, q, scale, chunk_size, cu_seqlens)
    ws = q.new_empty(ws_bytes, dtype=torch.uint8) if ws_bytes else None
    buf, a, kept = _pack((q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                          d_ok_state, cu_seqlens) + outs, _DQK_NAMES, _DQK_NIN, fresh)
    rc = F.dqktheta(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                    chunk_size, a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18],
                    None if ws is None else ws.data_ptr(), ws_bytes, stream)
    if rc:
        _lib.raise_status(rc)


def _dqktheta_functional(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                         d_ok_state, chunk_size, cu_seqlens):
    C = _C if _C_RESOLVED else _compiled()
    if C is not None:
        return C.compute_dqktheta(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                                  d_ok_state, chunk_size, cu_seqlens)
    return _dqktheta_functional_ctypes(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in,
                                       dqk, d_ok_state, chunk_size, cu_seqlens)


def _dqktheta_functional_ctypes(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                                d_ok_state, chunk_size, cu_seqlens):
    outs = _dqktheta_alloc(q, scale, gamma, angles, dq_in)
    _dqktheta_launch(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk, d_ok_state,
                     chunk_size, cu_seqlens, outs, True)
    return outs


@torch.library.custom_op("mamba3::compute_dqktheta", mutates_args=())
def _dqktheta_op(q: Tensor, k: Tensor, scale: Tensor, gamma: Tensor, q_bias: Tensor,
                 k_bias: Tensor, angles: Tensor, dq_in: Tensor, dk_in: Tensor, dqk: Tensor,
                 d_ok_state: Optional[Tensor], chunk_size: int, cu_seqlens: Optional[Tensor]
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _dqktheta_functional(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                                d_ok_state, chunk_size, cu_seqlens)


@_dqktheta_op.register_fake
def _dqktheta_fake(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk, d_ok_state,
                   chunk_size, cu_seqlens):
    B, S, G, N, H, A = _dqktheta_sizes(q, scale, angles)
    io = dq_in.dtype
    return (q.new_empty((B, S, G, N), dtype=io), q.new_empty((B, S, G, N), dtype=io),
            q.new_empty((H, N), dtype=_f32), q.new_empty((H, N), dtype=_f32),
            q.new_empty((B, S, H, A), dtype=angles.dtype),
            q.new_empty((B, H, S), dtype=scale.dtype), q.new_empty((B, H, S), dtype=gamma.dtype))


def compute_dqktheta(q: Tensor, k: Tensor, scale: Tensor, gamma: Tensor, q_bias: Tensor,
                     k_bias: Tensor, angles: Tensor, dq_in: Tensor, dk_in: Tensor, dqk: Tensor,
                     d_ok_state: Optional[Tensor] = None, chunk_size: int = 64,
                     cu_seqlens: Optional[Tensor] = None, *,
                     Cu_Seqlens: Optional[Tensor] = None):
    """Gradients through the q/k biases, the interleaved rotary embedding and the angles.

    q, k [B,S,G,N]; scale, gamma, dqk [B,H,S]; q_bias, k_bias [H,N]; angles [B,S,H,A] (A <= N/2);
    dq_in, dk_in [B,S,H,N]; d_ok_state [nseq,H,N] or None; cu_seqlens [nseq+1] (int32/int64, B=1)
    or None. Returns (dq, dk [B,S,G,N] in dq_in's dtype, dq_bias, dk_bias [H,N] f32,
    dangles [B,S,H,A] in angles' dtype, dscale [B,H,S] in scale's dtype, dgamma [B,H,S] in
    gamma's dtype). chunk_size (16..256) is accepted for API compatibility; results do not depend
    on it.
    """
    cu = cu_seqlens if Cu_Seqlens is None else _cu_arg(cu_seqlens, Cu_Seqlens)
    if type(chunk_size) is not int:
        chunk_size = operator.index(chunk_size)  # TypeError for a non-integer
    if q is None:
        _required("q", q)
    if _use_direct(q):
        return _dqktheta_functional(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in,
                                    dqk, d_ok_state, chunk_size, cu)
    return _dqktheta_op(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                        d_ok_state, chunk_size, cu)


def compute_dqktheta_out(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk,
                         d_ok_state=None, chunk_size=64, cu_seqlens=None, *, dq, dk, dq_bias,
                         dk_bias, dangles, dscale, dgamma, Cu_Seqlens=None):
    """compute_dqktheta writing into the given outputs (shapes/dtypes as its return values; every
    element is overwritten). Returns the outputs as a tuple."""
    cu = _cu_arg(cu_seqlens, Cu_Seqlens)
    _required("q", q)
    outs = (dq, dk, dq_bias, dk_bias, dangles, dscale, dgamma)
    work = _unit_stride_outputs(outs)
    _dqktheta_launch(q, k, scale, gamma, q_bias, k_bias, angles, dq_in, dk_in, dqk, d_ok_state,
                     operator.index(chunk_size), cu, work, False)
    _copy_back(outs, work)
    return outs


# ---------------------------------------------------------- compute_ddt_dtrap_dinput_states

_DDT_NAMES = ("dscale", "dgamma", "dt", "trap", "d_issm_state", "input_k_state", "input_v_state",
              "cu_seqlens", "ddt", "dtrap", "d_input_ssm_state", "d_input_k_state",
              "d_input_v_state")
_DDT_NIN = 8


def _ddt_sizes(dscale, d_issm_state):
    _required("dscale", dscale)
    if dscale.dim() != 3:
        raise _rank_error("dscale", dscale, "B,H,S")
    if d_issm_state is not None and d_issm_state.dim() != 4:
        raise _rank_error("d_issm_state", d_issm_state, "nseq,H,P,N")


def _ddt_alloc(dscale, d_issm_state):
    _ddt_sizes(dscale, d_issm_state)
    shape = dscale.shape
    ddt = dscale.new_empty(shape, dtype=_f32)
    dtrap = dscale.new_empty(shape, dtype=_f32)
    if d_issm_state is None:
        return ddt, dtrap, None, None, None
    nseq, H, P, N = d_issm_state.shape
    return (ddt, dtrap, dscale.new_empty((nseq, H, P, N), dtype=d_issm_state.dtype),
            dscale.new_empty((nseq, H, N), dtype=_f32),
            dscale.new_empty((nseq, H, P), dtype=_f32))


def _ddt_launch(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state, cu_seqlens,
                outs, fresh):
    F = _F or _fns()
    if dscale.is_cuda:
        dev = dscale.get_device()
        if dev != torch.cuda.current_device():
            with torch.cuda.device(dev):
                return _ddt_launch(dscale, dgamma, dt, trap, d_issm_state, input_k_state,
                                   input_v_state, cu_seqlens, outs, fresh)
        stream = _stream_of(dev)
    else:
        stream = None
    buf, a, kept = _pack((dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state,
                          cu_seqlens) + tuple(outs), _DDT_NAMES, _DDT_NIN, fresh)
    rc = F.ddt_dtrap(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
                     a[12], stream)
    if rc:
        _lib.raise_status(rc)


def _ddt_functional(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state,
                    cu_seqlens):
    C = _C if _C_RESOLVED else _compiled()
    if C is not None:
        return C.compute_ddt_dtrap_dinput_states(dscale, dgamma, dt, trap, d_issm_state,
                                                 input_k_state, input_v_state, cu_seqlens)
    return _ddt_functional_ctypes(dscale, dgamma, dt, trap, d_issm_state, input_k_state,
                                  input_v_state, cu_seqlens)


def _ddt_functional_ctypes(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state,
                           cu_seqlens):
    outs = _ddt_alloc(dscale, d_issm_state)
    _ddt_launch(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state, cu_seqlens,
                outs, True)
    return outs


# Two ops because a custom op cannot return an optional tensor: one without input states (two
# outputs), one with them (five). Both take the optional state tensors so that the library, not
# this wrapper, rejects an inconsistent combination (e.g. input_k_state without d_issm_state).
@torch.library.custom_op("mamba3::compute_ddt_dtrap", mutates_args=())
def _ddt_op(dscale: Tensor, dgamma: Tensor, dt: Tensor, trap: Tensor,
            input_k_state: Optional[Tensor], input_v_state: Optional[Tensor],
            cu_seqlens: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    return _ddt_functional(dscale, dgamma, dt, trap, None, input_k_state, input_v_state,
                           cu_seqlens)[:2]


@_ddt_op.register_fake
def _ddt_fake(dscale, dgamma, dt, trap, input_k_state, input_v_state, cu_seqlens):
    _ddt_sizes(dscale, None)
    return dscale.new_empty(dscale.shape, dtype=_f32), dscale.new_empty(dscale.shape, dtype=_f32)


@torch.library.custom_op("mamba3::compute_ddt_dtrap_dinput_states", mutates_args=())
def _ddt_states_op(dscale: Tensor, dgamma: Tensor, dt: Tensor, trap: Tensor, d_issm_state: Tensor,
                   input_k_state: Optional[Tensor], input_v_state: Optional[Tensor],
                   cu_seqlens: Optional[Tensor]
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _ddt_functional(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state,
                           cu_seqlens)


@_ddt_states_op.register_fake
def _ddt_states_fake(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state,
                     cu_seqlens):
    _ddt_sizes(dscale, d_issm_state)
    nseq, H, P, N = d_issm_state.shape
    return (dscale.new_empty(dscale.shape, dtype=_f32), dscale.new_empty(dscale.shape, dtype=_f32),
            d_issm_state.new_empty((nseq, H, P, N)), dscale.new_empty((nseq, H, N), dtype=_f32),
            dscale.new_empty((nseq, H, P), dtype=_f32))


def compute_ddt_dtrap_dinput_states(dscale: Tensor, dgamma: Tensor, dt: Tensor, trap: Tensor,
                                    d_issm_state: Optional[Tensor] = None,
                                    input_k_state: Optional[Tensor] = None,
                                    input_v_state: Optional[Tensor] = None,
                                    cu_seqlens: Optional[Tensor] = None, *,
                                    Cu_Seqlens: Optional[Tensor] = None):
    """dDT and dTrap (w.r.t. the pre-sigmoid trap) from dScale/dGamma, and the input-state
    gradients.

    dscale, dgamma, dt, trap [B,H,S]; d_issm_state [nseq,H,P,N], input_k_state [nseq,H,N] and
    input_v_state [nseq,H,P] all or none; cu_seqlens [nseq+1] (B=1) or None. Returns (ddt, dtrap
    [B,H,S] f32, d_input_ssm_state [nseq,H,P,N] in d_issm_state's dtype, d_input_k_state
    [nseq,H,N] f32, d_input_v_state [nseq,H,P] f32); the last three are None without states.
    """
    cu = cu_seqlens if Cu_Seqlens is None else _cu_arg(cu_seqlens, Cu_Seqlens)
    if dscale is None:
        _required("dscale", dscale)
    if _use_direct(dscale):
        return _ddt_functional(dscale, dgamma, dt, trap, d_issm_state, input_k_state,
                               input_v_state, cu)
    if d_issm_state is None:
        ddt, dtrap = _ddt_op(dscale, dgamma, dt, trap, input_k_state, input_v_state, cu)
        return ddt, dtrap, None, None, None
    return _ddt_states_op(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state,
                          cu)


def compute_ddt_dtrap_dinput_states_out(dscale, dgamma, dt, trap, d_issm_state=None,
                                        input_k_state=None, input_v_state=None, cu_seqlens=None,
                                        *, ddt, dtrap, d_input_ssm_state=None,
                                        d_input_k_state=None, d_input_v_state=None,
                                        Cu_Seqlens=None):
    """compute_ddt_dtrap_dinput_states writing into the given outputs (the three state outputs
    exactly when d_issm_state is given). Returns the five outputs (None where absent)."""
    cu = _cu_arg(cu_seqlens, Cu_Seqlens)
    _required("dscale", dscale)
    outs = (ddt, dtrap, d_input_ssm_state, d_input_k_state, d_input_v_state)
    work = _unit_stride_outputs(outs)
    _ddt_launch(dscale, dgamma, dt, trap, d_issm_state, input_k_state, input_v_state, cu, work,
                False)
    _copy_back(outs, work)
    return outs
