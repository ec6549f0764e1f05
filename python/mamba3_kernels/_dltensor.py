"""DLPack 0.6 DLTensor layout, torch-free: the constants, the struct formats used to pack DLTensors
and the same layout as ctypes structures (the reference the formats are checked against, and the
decoder used by tests).

Layout of DLTensor (third_party/dlpack/include/dlpack/dlpack.h, DLPACK_VERSION 60, x86-64/aarch64):
  0  void*    data
  8  int32    device.device_type   (kDLCPU = 1, kDLCUDA = 2)
  12 int32    device.device_id
  16 int32    ndim
  20 uint8    dtype.code           (kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5)
  21 uint8    dtype.bits
  22 uint16   dtype.lanes
  24 int64*   shape
  32 int64*   strides              (elements; NULL = compact row-major)
  40 uint64   byte_offset
"""
from __future__ import annotations

import ctypes
import struct

kDLCPU = 1
kDLCUDA = 2
kDLExtDev = 12  # stands for "some other device": the library rejects it, naming the argument

kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex = 0, 1, 2, 4, 5

MAX_DIMS = 6  # the library's kMaxDims
DLTENSOR_SIZE = 48
# A packing slot: the DLTensor followed by room for its shape and strides.
SLOT = DLTENSOR_SIZE + 2 * 8 * MAX_DIMS

# One compiled Struct per rank: the DLTensor, then `ndim` shape entries, then `ndim` strides.
STRUCTS = tuple(struct.Struct("<QiiiBBHQQQ%dq" % (2 * nd)) for nd in range(MAX_DIMS + 1))
# The same without strides (strides pointer NULL: compact row-major).
COMPACT_STRUCTS = tuple(struct.Struct("<QiiiBBHQQQ%dq" % nd) for nd in range(MAX_DIMS + 1))
assert STRUCTS[0].size == DLTENSOR_SIZE


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def pack_raw(buf, off, data, device_type, device_id, code, bits, shape, strides=None):
    """Packs one DLTensor at byte `off` of the ctypes buffer `buf` from plain values (strides
    None: compact); returns its address. Used where no torch tensor exists (tests)."""
    addr = ctypes.addressof(buf) + off
    nd = len(shape)
    if strides is None:
        COMPACT_STRUCTS[nd].pack_into(buf, off, data, device_type, device_id, nd, code, bits, 1,
                                      addr + DLTENSOR_SIZE, 0, 0, *shape)
    else:
        STRUCTS[nd].pack_into(buf, off, data, device_type, device_id, nd, code, bits, 1,
                              addr + DLTENSOR_SIZE, addr + DLTENSOR_SIZE + 8 * nd, 0,
                              *shape, *strides)
    return addr


def read_back(addr: int) -> dict:
    """Decodes the DLTensor at `addr` through the ctypes structures (strides None when NULL)."""
    t = DLTensor.from_address(addr)
    nd = t.ndim
    return dict(data=t.data or 0, device_type=t.device.device_type, device_id=t.device.device_id,
                ndim=nd, code=t.dtype.code, bits=t.dtype.bits, lanes=t.dtype.lanes,
                shape=tuple(t.shape[i] for i in range(nd)),
                strides=tuple(t.strides[i] for i in range(nd)) if t.strides else None,
                byte_offset=t.byte_offset)
