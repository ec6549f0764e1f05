"""DLTensors for the C API, built straight from torch tensors.

torch.utils.dlpack is not used: it creates a capsule and a managed tensor per call, which costs
more than the small kernels it would feed. Instead all DLTensors of one call are packed with one
struct.pack_into per tensor into a single ctypes buffer: for every tensor a 144-byte slot holds the
48-byte DLTensor (layout in _dltensor.py) followed by its shape and strides (int64, in elements),
and the DLTensor's shape and strides pointers point into the same slot; data is data_ptr() (which
already includes the storage offset) and byte_offset is 0. The buffer is created per call (no
shared state, so concurrent calls from several threads are safe) and must be kept alive until the
C call returns; the library reads the structs only during the call.
"""
from __future__ import annotations

import ctypes

import torch

from ._dltensor import (DLTENSOR_SIZE, MAX_DIMS, SLOT, DLDataType, DLDevice, DLTensor,  # noqa: F401
                        kDLBfloat, kDLComplex, kDLCPU, kDLCUDA, kDLExtDev, kDLFloat, kDLInt,
                        kDLUInt, read_back)
from ._dltensor import COMPACT_STRUCTS as _COMPACT_STRUCTS
from ._dltensor import STRUCTS as _STRUCTS

_DTYPES = {
    torch.float16: (kDLFloat, 16),
    torch.bfloat16: (kDLBfloat, 16),
    torch.float32: (kDLFloat, 32),
    torch.float64: (kDLFloat, 64),
    torch.int8: (kDLInt, 8),
    torch.int16: (kDLInt, 16),
    torch.int32: (kDLInt, 32),
    torch.int64: (kDLInt, 64),
    torch.uint8: (kDLUInt, 8),
    torch.bool: (kDLUInt, 8),
    torch.complex64: (kDLComplex, 64),
    torch.complex128: (kDLComplex, 128),
}


def dl_dtype(dtype: torch.dtype):
    """(code, bits) of a torch dtype. Types the library does not take still get a faithful code so
    that its error message (which names the argument) is the one the user sees."""
    r = _DTYPES.get(dtype)
    if r is None:
        bits = torch.empty((), dtype=dtype).element_size() * 8
        code = kDLComplex if dtype.is_complex else (kDLFloat if dtype.is_floating_point else kDLUInt)
        r = (code, bits)
        _DTYPES[dtype] = r
    return r


def pack(tensors, names, n_inputs, compact_outputs=False):
    """Packs `tensors` (torch.Tensor or None each) into one buffer.

    Returns (buffer, addresses, kept): `addresses[i]` is the DLTensor* of tensors[i] as an int (None
    for an absent tensor), `buffer` must stay referenced until the C call returns, and `kept`
    holds tensors created here. The first `n_inputs` tensors are inputs: one whose last dimension
    is not unit-stride is replaced by a contiguous copy (the documented front-end rule: the
    library then always sees unit-stride rows). Later tensors (outputs) are passed as they are;
    with compact_outputs (outputs freshly allocated by the caller, contiguous, on the inputs'
    device) their strides pointer is NULL, which DLPack defines as compact row-major, and their
    device is taken from the inputs without asking torch again (were the inputs on several
    devices, the library rejects the call for that reason before looking at the outputs).
    """
    buf = (ctypes.c_char * (SLOT * len(tensors)))()
    base = ctypes.addressof(buf)
    addrs = []
    kept = None
    dtypes = _DTYPES
    structs = _STRUCTS
    compact = _COMPACT_STRUCTS
    dev = dev_id = 0
    off = 0
    for i, t in enumerate(tensors):
        if t is None:
            addrs.append(None)
            off += SLOT
            continue
        addr = base + off
        shape = t.shape
        nd = len(shape)
        if nd > MAX_DIMS:
            raise ValueError(f"{names[i]}: rank {nd} is not supported (at most {MAX_DIMS})")
        dt = dtypes.get(t.dtype) or dl_dtype(t.dtype)
        if compact_outputs and i >= n_inputs:
            compact[nd].pack_into(buf, off, t.data_ptr(), dev, dev_id, nd, dt[0], dt[1], 1,
                                  addr + DLTENSOR_SIZE, 0, 0, *shape)
        else:
            st = t.stride()
            if nd and st[-1] != 1 and shape[-1] != 1 and i < n_inputs:
                t = t.contiguous()
                st = t.stride()
                kept = [t] if kept is None else kept + [t]
            if t.is_cuda:
                dev, dev_id = kDLCUDA, t.get_device()
            elif t.is_cpu:
                dev, dev_id = kDLCPU, 0
            else:
                dev, dev_id = kDLExtDev, 0
            structs[nd].pack_into(buf, off, t.data_ptr(), dev, dev_id, nd, dt[0], dt[1], 1,
                                  addr + DLTENSOR_SIZE, addr + DLTENSOR_SIZE + 8 * nd, 0,
                                  *shape, *st)
        addrs.append(addr)
        off += SLOT
    return buf, addrs, kept
