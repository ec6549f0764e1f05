"""Helpers shared by the operator modules (siso.py, mimo.py): stream lookup, the choice between
the eager fast path and the custom op, argument errors, and caller-given outputs."""
from __future__ import annotations

import torch
from torch import Tensor

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
# torch's own raw-stream accessor (what Inductor-generated code uses): returns the cudaStream_t as
# an int without creating a torch.cuda.Stream object. Public fallback if a build lacks it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(dev_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(dev_index)
    return torch.cuda.current_stream(dev_index).cuda_stream


def use_direct(t: Tensor) -> bool:
    """True when the eager fast path (direct library call) may be taken for a call whose first
    tensor argument is `t`: not while compiling, not for tensor subclasses (FakeTensor,
    FunctionalTensor, ...), meta tensors or under an active dispatch mode."""
    if _is_compiling() or type(t) is not _Tensor or t.is_meta:
        return False
    return _dispatch_stack_len is None or _dispatch_stack_len() == 0


def rank_error(name: str, t: Tensor, expected: str) -> ValueError:
    return ValueError(f"{name}: expected rank {len(expected.split(','))} [{expected}], "
                      f"got shape {list(t.shape)}")


def required(name, t):
    if t is None:
        raise ValueError(f"{name} is required but was None")


def unit_stride_outputs(outs):
    """Outputs as handed to the library: a caller's output whose last dimension is not
    unit-stride is replaced by a contiguous temporary of the same shape/dtype/device."""
    work = []
    for o in outs:
        if o is not None and o.dim() and o.stride(-1) != 1 and o.shape[-1] != 1:
            o = torch.empty(o.shape, dtype=o.dtype, device=o.device)
        work.append(o)
    return tuple(work)


def copy_back(outs, work):
    for o, w in zip(outs, work):
        if o is not w:
            o.copy_(w)
